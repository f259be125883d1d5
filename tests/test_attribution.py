"""The attribution proof (`dpmem.methods.attribution`): models whose per-sample gradients a shape rule would get
wrong are refused before anything is released, naming what mixes samples and the fix; models whose inputs are
shared by the batch (position ids of shape (1, T)) train exactly, against a loop of one-sample backward passes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmem.methods import build_method, method_config
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.privatize import Privatizer
from dpmem.privacy.mechanism import GaussianMechanism
from helpers import engine_grads, loop_grads, seeded

PLANS = ["materialize", "bk", "ghost", "mixed", "fgc"]  # every exact plan: one pass (the first two), two passes
B = 4


pytestmark = pytest.mark.usefixtures("float64")


def clipped_sum(model, loss, batch, plan, C, check=True):
    """The Privatizer's release with the noise off and an expected batch of 1: Σᵢ min(1, C/‖gᵢ‖)·gᵢ, by name."""
    names = {p: n for n, p in model.named_parameters()}
    with Privatizer(model, GaussianMechanism(0.0, C, 1.0, seeded(0)), ClippingPlan.of(plan), check) as privatize:
        out, _ = privatize.gradient([batch], loss, {p: p.shape for p in privatize.params})
    return {names[p]: g for p, g in out.items()}


def oracle(model, loss, batch, C):
    """Each sample's gradient alone (a backward pass per sample), clipped by its flat norm and summed."""
    per = loop_grads(model, loss, batch, B)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
    factors = (C / (norms + 1e-6)).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", factors, g) for n, g in per.items()}, norms


def text_batch(vocab=40, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # one padded sample
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (B,), generator=g)}


def classifier_loss(m, b):
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return F.cross_entropy(logits, b["labels"], reduction="none")


def causal_loss(m, b):
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
    target = b["input_ids"][:, 1:].masked_fill(b["attention_mask"][:, 1:] == 0, -100)
    return F.cross_entropy(logits.transpose(1, 2), target, reduction="none", ignore_index=-100).sum(1)


def bert():
    from transformers import BertConfig, BertForSequenceClassification
    return BertForSequenceClassification(BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)), \
        classifier_loss


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)), causal_loss


def distilbert():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    return DistilBertForSequenceClassification(DistilBertConfig(
        vocab_size=40, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=16, dropout=0.0,
        attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=3)), classifier_loss


SHARED_POSITIONS = {"bert": bert, "gpt2": gpt2, "distilbert": distilbert}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("family", SHARED_POSITIONS)
def test_position_ids_shared_by_the_batch_get_each_samples_own_gradient(family, plan):
    """BERT, GPT-2 and DistilBERT look their positions up once, (1, T), broadcast over the batch: the clipped sum
    under every plan equals the loop's, with some samples clipped and some not."""
    torch.manual_seed(0)
    model, loss = SHARED_POSITIONS[family]()
    batch = text_batch()
    want, norms = oracle(model, loss, batch, C := float(norms_median(model, loss, batch)))
    assert (norms > C).any() and (norms < C).any()
    got = clipped_sum(model, loss, batch, plan, C)
    position = next(n for n in want if "position" in n or "wpe" in n)
    assert want[position].norm() > 0
    for n in want:
        err = (got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-9)
        assert err <= 1e-6, f"{n}: relative error {err:.1e}"


def norms_median(model, loss, batch):
    return oracle(model, loss, batch, 1.0)[1].median()


@pytest.mark.parametrize("family", SHARED_POSITIONS)
def test_grape_on_shared_positions_releases_the_sum_of_its_samples_releases(family):
    """DP-GRAPE's projected, clipped sum of a batch equals the sum of its samples' releases, each alone from the same
    start (one sample per batch: no sample to mix with)."""
    def release(samples):
        torch.manual_seed(0)
        model, loss = SHARED_POSITIONS[family]()
        method = build_method(method_config("grape", rank=4, max_grad_norm=0.5), model, 0.0,
                              GaussianMechanism(0.0, 0.5, 1.0, seeded(3)))
        batch = text_batch()
        part = {k: v[samples] for k, v in batch.items()}
        out, _ = method.privatizer.gradient([part], loss, method.shapes, method._projections(1))
        return torch.cat([g.flatten() for g in out.values()])

    alone = sum(release([i]) for i in range(B))
    torch.testing.assert_close(release(list(range(B))), alone, rtol=1e-8, atol=1e-10)


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    model = T5ForConditionalGeneration(T5Config(
        vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1, 40, (B, 8), generator=g),
             "labels": torch.randint(1, 40, (B, B), generator=g)}

    def loss(m, b):
        logits = m(input_ids=b["input_ids"], labels=b["labels"]).logits
        return F.cross_entropy(logits.transpose(1, 2), b["labels"], reduction="none").sum(1)
    return model, loss, batch


@pytest.mark.parametrize("plan", PLANS)
def test_t5_at_batch_4_is_refused_naming_its_position_bias(plan):
    """T5's relative attention bias is looked up from (query, key) buckets with no batch dimension: 8 rows at a
    batch of 4 look like batch-major rows, but every sample uses all of them. Without the proof its clipped sum is
    silently wrong (the check-off run below differs from the loop); with it, the run is refused."""
    torch.manual_seed(0)
    model, loss, batch = t5()
    with pytest.raises(RuntimeError, match=r"relative_attention_bias.*not B samples' rows batch-major.*freeze"):
        clipped_sum(model, loss, batch, plan, 1e-3)
    # the taps alone (no proof): each "sample's" bias gradient is a slice of every sample's rows, while the rows
    # still sum to the batch gradient (which the old coverage check compared)
    got, want = engine_grads(model, loss, batch), loop_grads(model, loss, batch, B)
    name = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    torch.testing.assert_close(got[name].sum(0), want[name].sum(0))
    assert (got[name] - want[name]).norm() > 0.5 * want[name].norm()  # what the proof guards against


def test_t5_trains_exactly_with_its_position_bias_frozen():
    torch.manual_seed(0)
    model, loss, batch = t5()
    for n, p in model.named_parameters():
        p.requires_grad_("relative_attention_bias" not in n)
    want, norms = oracle(model, loss, batch, C := float(norms_median(model, loss, batch)))
    got = clipped_sum(model, loss, batch, "bk", C)
    for n in want:
        assert (got[n] - want[n]).norm() <= 1e-6 * want[n].norm().clamp_min(1e-9), n


class Mix(nn.Module):
    """A batch statistic inside a forward: every sample's output moves with the others'."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class Net(nn.Module):
    def __init__(self, mix=False, inline=False, shared=False, unseen=False):
        super().__init__()
        self.emb, self.a, self.b, self.c = nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 3), nn.Linear(6, 6)
        self.mix = Mix() if mix else nn.Identity()
        self.inline, self.shared, self.unseen = inline, shared, unseen
        self.register_buffer("table", torch.randn(B, 6))  # B rows that are not samples

    def forward(self, ids):
        h = self.emb(ids).mean(1)
        if self.shared:  # a (B, 6) input taken for a batch: each sample uses all of c's rows
            h = h + self.c(self.table).sum(0)
        h = self.mix(self.a(h).tanh())
        if self.unseen:  # c's weight read by the parent, c never called, its gradient tiny: no tap sees it at all
            h = h + 1e-9 * F.linear(h, self.c.weight)
        if self.inline:
            h = h - h.mean(0)
        return self.b(h)


def net_batch():
    g = torch.Generator().manual_seed(0)
    return {"ids": torch.randint(0, 10, (B, 5), generator=g), "y": torch.randint(0, 3, (B,), generator=g)}


def net_loss(m, b):
    return F.cross_entropy(m(b["ids"]), b["y"], reduction="none")


REFUSED = {
    "loss-mean": (Net, lambda m, b: net_loss(m, b).mean().expand(B), r"the loss function mixes samples"),
    "mixing-module": (lambda: Net(mix=True), net_loss, r"^.*: mix mixes samples.*act on each sample alone"),
    "mixing-code": (lambda: Net(inline=True), net_loss, r"the forward of Net mixes samples between mix and b"),
    "rows-not-samples": (lambda: Net(shared=True), net_loss, r"c's output has B rows that are not samples'.*freeze"),
    "weight-of-a-module-never-called": (lambda: Net(unseen=True), net_loss,
                                        r"of c\.weight are not each sample's own.*c\.weight is used outside"),
}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", REFUSED)
def test_what_mixes_samples_is_refused_before_a_release_naming_it(case, plan):
    """Each passes the loss's shape check and the old coverage check (the rows still sum to the batch gradient)."""
    torch.manual_seed(0)
    make, loss, words = REFUSED[case]
    model = make()
    noise = GaussianMechanism(1.0, 1.0, 1.0, seeded(0))
    with Privatizer(model, noise, ClippingPlan.of(plan)) as privatize:
        with pytest.raises(RuntimeError, match=words):
            privatize.gradient([net_batch()], loss, {p: p.shape for p in privatize.params})
    assert noise.state.noise.count == 0  # nothing drawn, so nothing released


def test_a_new_layout_is_proved_again_before_its_release():
    """A layer read as B·k batch-major rows is proved at each new k: a model that reads positions as rows only at
    the second step's sequence length is refused there, after the first step's proof passed."""
    class Rows(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos, self.head = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, ids):
            h = self.emb(ids)  # (B, T, 4)
            if ids.shape[1] == 2 * ids.shape[0]:  # a table of T rows shared by the batch
                h = h + self.pos(torch.ones(ids.shape[1], 4)).unsqueeze(0)
            else:  # the same layer on B·T token rows, batch-major
                h = h + self.pos(h.reshape(-1, 4)).reshape(h.shape)
            return self.head(h.mean(1))

    torch.manual_seed(0)
    model = Rows()
    g = torch.Generator().manual_seed(0)
    step = lambda T: {"ids": torch.randint(0, 10, (B, T), generator=g), "y": torch.randint(0, 3, (B,), generator=g)}  # noqa: E731
    with Privatizer(model, GaussianMechanism(0.0, 1.0, 1.0, seeded(0)), ClippingPlan.of("bk")) as privatize:
        shapes = {p: p.shape for p in privatize.params}
        privatize.gradient([step(5)], net_loss, shapes)  # B·5 rows: batch-major, proved
        privatize.gradient([step(5)], net_loss, shapes)  # the same layout: no new proof
        with pytest.raises(RuntimeError, match=r"pos's output has 2·B rows, which are not B samples'"):
            privatize.gradient([step(2 * B)], net_loss, shapes)


@pytest.mark.parametrize("plan", PLANS)
def test_a_misread_layer_whose_gradients_are_a_millionth_of_the_largest_is_still_refused(plan):
    """Each parameter's rounding is measured against its own module's gradients, not the whole model's: a table of
    B rows read as the batch's, its contribution scaled by 1e-6, is refused (its whole gradient is within 1e-4 of the
    model's largest entry, which the proof took for rounding when it measured every parameter against that)."""
    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos, self.head = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 3)
            self.register_buffer("table", torch.randn(B, 4))  # B rows that are not samples

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1) + 1e-6 * self.pos(self.table).sum(0))

    torch.manual_seed(0)
    model = Small()
    with Privatizer(model, GaussianMechanism(0.0, 1.0, 1.0, seeded(0)), ClippingPlan.of(plan)) as privatize:
        with pytest.raises(RuntimeError, match=r"per-sample gradients of pos\.(weight|bias).*pos's output has B rows"):
            privatize.gradient([net_batch()], net_loss, {p: p.shape for p in privatize.params})
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None for g in grads.values())  # the proof clears what it compared


def test_an_input_with_no_batch_dimension_is_refused_in_the_forward_naming_the_layer():
    """T5's buckets at batch 3: 8 rows are neither B, 1 nor B·k; never cut into pieces."""
    model, loss, batch = t5()
    batch = {k: v[:3] for k, v in batch.items()}
    with Privatizer(model, GaussianMechanism(0.0, 1.0, 1.0, seeded(0)), ClippingPlan.of("bk")) as privatize:
        with pytest.raises(ValueError, match=r"relative_attention_bias: Embedding's output has shape \(8, 8, 2\) for "
                                             r"a batch of 3.*freeze its parameters"):
            privatize.gradient([batch], loss, {p: p.shape for p in privatize.params})


class ScaledEmbedding(nn.Embedding):
    """Gemma's word embedding: an nn.Embedding whose forward scales the lookup by √d."""

    def forward(self, ids):
        return super().forward(ids) * self.embedding_dim ** 0.5


class SquashedLinear(nn.Linear):
    """A Linear subclass whose forward transforms its input before F.linear and its output after."""

    def forward(self, x):
        return F.linear(x.tanh(), self.weight, self.bias) * 1.5 + 0.1


class MatmulLinear(nn.Linear):
    """A Linear subclass whose forward never calls F.linear (Falcon's): read at its input and output, and proved."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


class DoubledLinear(nn.Linear):
    """As MatmulLinear, with its output doubled: no rule sees the doubling, and the proof refuses it."""

    def forward(self, x):
        return (x @ self.weight.T + self.bias) * 2


class Subclassed(nn.Module):
    def __init__(self, embedding=ScaledEmbedding, linear=SquashedLinear):
        super().__init__()
        self.emb, self.a, self.head = embedding(10, 4), linear(4, 4), nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(self.a(self.emb(ids)).mean(1))


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("linear", [SquashedLinear, MatmulLinear])
def test_subclasses_with_a_forward_of_their_own_are_tapped_at_their_call_and_exact(linear, plan):
    """The Embedding and Linear rules read the F.embedding/F.linear call inside the subclass's forward (ids or
    input, and the call's output gradient), so the scaling and squashing around it are differentiated by autograd;
    a forward that makes no such call is read at its input and output, and proved: the clipped sum equals a loop of
    one-sample backward passes."""
    torch.manual_seed(0)
    model = Subclassed(linear=linear)
    C = float(norms_median(model, net_loss, net_batch()))
    want, _ = oracle(model, net_loss, net_batch(), C)
    got = clipped_sum(model, net_loss, net_batch(), plan, C)
    for name, g in want.items():
        assert (got[name] - g).norm() <= 1e-12 * g.norm(), name


class FailingEmbedding(ScaledEmbedding):
    """Raises after its F.embedding call, inside its own forward."""

    def forward(self, ids):
        super().forward(ids)
        raise RuntimeError("the subclass failed")


def test_a_subclass_whose_forward_raises_leaves_no_mode_behind():
    """Its tapped call is left when the forward pass that raised ends: torch's mode stack is empty again and the next
    model's step is exact."""
    torch.manual_seed(0)
    with Privatizer(Subclassed(embedding=FailingEmbedding), GaussianMechanism(0.0, 1.0, 1.0, seeded(0)),
                    ClippingPlan.of("bk")) as privatize:
        with pytest.raises(RuntimeError, match="the subclass failed"):
            privatize.gradient([net_batch()], net_loss, {p: p.shape for p in privatize.params})
    assert torch._C._len_torch_function_stack() == 0
    model = Subclassed()
    C = float(norms_median(model, net_loss, net_batch()))
    want, _ = oracle(model, net_loss, net_batch(), C)
    got = clipped_sum(model, net_loss, net_batch(), "bk", C)
    assert all((got[n] - g).norm() <= 1e-12 * g.norm() for n, g in want.items())


def test_a_subclass_whose_forward_no_rule_models_is_refused_by_the_proof_naming_it():
    torch.manual_seed(0)
    with Privatizer(Subclassed(linear=DoubledLinear), GaussianMechanism(0.0, 1.0, 1.0, seeded(0)),
                    ClippingPlan.of("bk")) as privatize:
        with pytest.raises(RuntimeError, match=r"a\.weight \(and 1 more\) are not each sample's own.*a\.weight is used "
                                               r"outside the module that owns it \(or by a forward its rule does not "
                                               r"model\)"):
            privatize.gradient([net_batch()], net_loss, {p: p.shape for p in privatize.params})


@pytest.mark.parametrize("where", ["compiled", "user-level"])
def test_the_proof_refuses_a_mixing_module_under_a_compiled_step_and_user_level_clipping(where):
    """A compiled step proves on its eager rehearsal of the first micro-batch; user-level clipping proves per user
    (each record weighed by its user's w), its k records' sum being what is clipped."""
    from dpmem.compiling import Compiler
    from dpmem.data.bundle import Grouped

    torch.manual_seed(0)
    model = Net(mix=True)
    method = build_method(method_config("dp-adam", clipping="bk", max_grad_norm=1.0), model, 0.01,
                          GaussianMechanism(1.0, 1.0, 2.0, seeded(7)))
    data = net_batch()
    if where == "compiled":
        method.compile(Compiler(torch.device("cpu"), "eager"))
    else:  # 2 users of 2 records each, every slot filled
        data = Grouped(data, 2, torch.ones(B))
    with pytest.raises(RuntimeError, match=r"mix mixes samples"):
        method.step([data], net_loss)
    assert method.privatizer.mechanism.state.noise.count == 0


@pytest.mark.parametrize("plan", ["bk", "ghost"])
def test_user_level_clipping_of_shared_positions_is_proved_and_exact(plan):
    """GPT-2's positions (1, T) under user-level clipping: each user's clipped sum of its records' gradients equals
    the loop's."""
    from dpmem.data.bundle import Grouped

    torch.manual_seed(0)
    model, loss = gpt2()
    data = text_batch()
    del data["labels"]
    per = loop_grads(model, causal_loss, data, B)
    users = {n: g.view(2, 2, *g.shape[1:]).sum(1) for n, g in per.items()}  # users (0, 1), (2, 3)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in users.values()]).sum(0).sqrt()
    C = float(norms.min())  # one user clipped, at least
    factors = (C / (norms + 1e-6)).clamp(max=1.0)
    names = {p: n for n, p in model.named_parameters()}
    with Privatizer(model, GaussianMechanism(0.0, C, 1.0, seeded(0), per_user=True), ClippingPlan.of(plan)) as pr:
        got, _ = pr.gradient([Grouped(data, 2, torch.ones(B))], causal_loss, {p: p.shape for p in pr.params})
    for p, g in got.items():
        want = torch.einsum("u,u...->...", factors, users[names[p]])
        assert (g - want).norm() <= 1e-6 * want.norm().clamp_min(1e-9), names[p]


def hub_model(model_type):
    """A tiny random-init model of a hub family no dpmem config builds, by its config class alone."""
    import transformers as tf
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=40,
                 max_position_embeddings=32)
    quiet = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    configs = {
        "electra": lambda: tf.ElectraConfig(**small, **quiet, embedding_size=16),
        "albert": lambda: tf.AlbertConfig(**small, **quiet, embedding_size=8, classifier_dropout_prob=0.0),
        "qwen2": lambda: tf.Qwen2Config(**small, num_key_value_heads=1),
        "mistral": lambda: tf.MistralConfig(**small, num_key_value_heads=1),
        "phi3": lambda: tf.Phi3Config(**small, num_key_value_heads=1, pad_token_id=0),
        "gpt-neox": lambda: tf.GPTNeoXConfig(**small, hidden_dropout=0.0, attention_dropout=0.0),
        "falcon": lambda: tf.FalconConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          hidden_dropout=0.0, attention_dropout=0.0),
        # its word embedding scales the lookup by √d in its own forward
        "gemma3": lambda: tf.Gemma3TextConfig(**small, num_key_value_heads=1, head_dim=8, sliding_window=8),
    }
    causal = model_type not in ("electra", "albert")
    auto = tf.AutoModelForCausalLM if causal else tf.AutoModelForSequenceClassification
    return auto.from_config(configs[model_type]()), causal_loss if causal else classifier_loss


@pytest.mark.parametrize("plan", ["bk", "ghost"])
@pytest.mark.parametrize("model_type", ["electra", "albert", "qwen2", "mistral", "phi3", "gpt-neox", "falcon",
                                        "gemma3"])
def test_hub_families_without_a_dpmem_config_are_proved_and_exact(model_type, plan):
    torch.manual_seed(0)
    model, loss = hub_model(model_type)
    batch = text_batch()
    C = float(norms_median(model, loss, batch))
    want, _ = oracle(model, loss, batch, C)
    got = clipped_sum(model, loss, batch, plan, C)
    flat = lambda d: torch.cat([d[n].flatten() for n in want])  # noqa: E731
    # Llama-style RMSNorm and rotary embeddings compute in float32 inside a float64 model: two-pass clipping's
    # backward of Σᵢ fᵢ ℓᵢ rounds fᵢ·Gᵢ there, where the loop rounds Gᵢ (4e-8 relative, measured); one pass: 1e-15
    assert (flat(got) - flat(want)).norm() <= (1e-6 if plan == "ghost" else 1e-12) * flat(want).norm()


def deberta_v2(share_att_key: bool, table_trainable: bool = False):
    """A tiny DeBERTa-v2 (v3's layout with share_att_key): its relative-position table frozen unless asked."""
    import transformers as tf
    model = tf.AutoModelForSequenceClassification.from_config(tf.DebertaV2Config(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0,
        num_labels=3, relative_attention=True, position_buckets=8, max_relative_positions=16,
        pos_att_type=["p2c", "c2p"], share_att_key=share_att_key, norm_rel_ebd="layer_norm"))
    if not table_trainable:
        for p in (*model.deberta.encoder.rel_embeddings.parameters(), *model.deberta.encoder.LayerNorm.parameters()):
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("share_att_key", [True, False])
def test_deberta_v2_is_exact_with_its_attention_replayed_per_sample(share_att_key, plan):
    """Its attention projects the shared relative-position table and repeats it by the batch itself: replayed one
    sample at a time (repeated by 1), every projection's per-sample gradient is exact."""
    torch.manual_seed(0)
    model = deberta_v2(share_att_key)
    batch = text_batch()
    C = float(norms_median(model, classifier_loss, batch))
    want, _ = oracle(model, classifier_loss, batch, C)
    got = clipped_sum(model, classifier_loss, batch, plan, C)
    flat = lambda d: torch.cat([d[n].flatten() for n in want])  # noqa: E731
    assert (flat(got) - flat(want)).norm() <= 1e-12 * flat(want).norm()


def test_deberta_v2_s_relative_position_table_trainable_is_refused_naming_it():
    """The table is read as a weight and reaches every sample's loss: no tap sees it, and the proof says so."""
    torch.manual_seed(0)
    model = deberta_v2(share_att_key=True, table_trainable=True)
    with Privatizer(model, GaussianMechanism(0.0, 1.0, 1.0, seeded(0)), ClippingPlan.of("bk")) as privatize:
        with pytest.raises(RuntimeError, match=r"deberta\.encoder\.rel_embeddings\.weight is used outside the "
                                               r"module that owns it.*freeze it"):
            privatize.gradient([text_batch()], classifier_loss, {p: p.shape for p in privatize.params})


def swin(bias_trainable: bool = False):
    """A tiny Swin: 16×16 images in 2×2 windows, so block 0 sees (B·16 windows, 4 positions, C) at B = 4, which reads
    time-major too (its second dimension is B); block 0's position bias frozen unless asked."""
    import transformers as tf
    model = tf.AutoModelForImageClassification.from_config(tf.SwinConfig(
        image_size=16, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2,
        drop_path_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))
    if not bias_trainable:
        model.swin.encoder.layers[0].blocks[0].attention.relative_position_bias.requires_grad_(False)
    return model


def image_loss(m, b):
    return F.cross_entropy(m(pixel_values=b["pixel_values"]).logits, b["labels"], reduction="none")


def image_batch():
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(B, 3, 16, 16, generator=g), "labels": torch.randint(0, 3, (B,), generator=g)}


@pytest.mark.parametrize("plan", PLANS)
def test_swin_s_windows_are_read_as_the_proof_finds_them_and_exact(plan):
    """Block 0's (B·16, 4, C) windows are read time-major first; the proof fails there, and the micro-batch runs
    again with those layers read as B·16 batch-major rows (the windows of each image), proved so, and exact."""
    torch.manual_seed(0)
    model = swin()
    C = float(norms_median(model, image_loss, image_batch()))
    want, _ = oracle(model, image_loss, image_batch(), C)
    got = clipped_sum(model, image_loss, image_batch(), plan, C)
    flat = lambda d: torch.cat([d[n].flatten() for n in want])  # noqa: E731
    assert (flat(got) - flat(want)).norm() <= 1e-12 * flat(want).norm()


def test_an_output_shared_by_the_batch_whose_broadcast_breaks_the_forward_is_refused_naming_it():
    """Swin's position bias, (1, heads, 4, 4), is added to B·16 windows' scores: broadcast to B rows, the forward
    fails; left shared it runs, so the refusal names the layer and says to freeze it."""
    torch.manual_seed(0)
    noise = GaussianMechanism(1.0, 1.0, 1.0, seeded(0))
    with Privatizer(swin(bias_trainable=True), noise, ClippingPlan.of("bk")) as privatize:
        with pytest.raises(RuntimeError, match=r"^swin\.encoder\.layers\.0\.blocks\.0\.attention\."
                                               r"relative_position_bias: its output is shared by the batch.*broke the "
                                               r"model's forward.*freeze its parameters"):
            privatize.gradient([image_batch()], image_loss, {p: p.shape for p in privatize.params})
    assert noise.state.noise.count == 0


def test_a_loss_of_the_wrong_shape_is_refused_as_such_where_a_shared_output_was_broadcast():
    """BERT's positions are broadcast before a batch-mean loss fails the shape check: the refusal is the loss's."""
    torch.manual_seed(0)
    model, _ = bert()
    mean = lambda m, b: classifier_loss(m, b).mean()  # noqa: E731
    with Privatizer(model, GaussianMechanism(0.0, 1.0, 1.0, seeded(0)), ClippingPlan.of("bk")) as privatize:
        with pytest.raises(ValueError, match=r"^the loss function returned shape \(\) for a micro-batch of 4"):
            privatize.gradient([text_batch()], mean, {p: p.shape for p in privatize.params})


def test_a_parameter_whose_gradient_diverged_proves_nothing_and_the_others_are_still_compared():
    """Weights a huge learning rate made infinite: no tolerance is defined for them, so the proof leaves them to
    the trainer's non-finite check (which ends the run with its own line); a finite parameter that differs still
    refuses."""
    from dpmem.methods.attribution import verify_attribution
    model = nn.Linear(2, 2)
    model.weight.grad, model.bias.grad = torch.full((2, 2), float("inf")), torch.ones(2)
    verify_attribution(model, [model.weight, model.bias], {model.weight: torch.zeros(2, 2), model.bias: torch.ones(2)})
    assert model.weight.grad is None and model.bias.grad is None
    model.weight.grad, model.bias.grad = torch.full((2, 2), float("inf")), torch.ones(2)
    with pytest.raises(RuntimeError, match="the per-sample gradients of bias are not each sample's own"):
        verify_attribution(model, [model.weight, model.bias], {model.weight: torch.zeros(2, 2),
                                                                model.bias: torch.zeros(2)})
