"""LoRA through peft (DP-LoRA): per-sample gradients of the adapters against a one-sample-at-a-time loop, a clear
error for adapters no rule covers, training that moves only the adapters and the head, config and planning."""

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dpmem.composition import CONF_DIR
from dpmem.config import ConfigError, ModelConfig
from dpmem.data import build_data
from dpmem.engine.planner import plan
from dpmem.methods import build_method, method_class, method_config
from dpmem.models import build_model
from dpmem.models.lora import apply_lora
from dpmem.persample import Taps, reducers
from dpmem.privacy.mechanism import GaussianMechanism
from helpers import assert_close, engine_grads, loop_grads, seeded



def lora_cfg(head, **lora):
    return OmegaConf.merge(OmegaConf.structured(ModelConfig),
                           {"name": "tiny", "family": "tiny", "head": head, "lora": {"r": 4, **lora}})


def adapters_made_nonzero(model):
    """peft starts B at 0, which makes A's gradient vanish: random adapters give both a gradient to check."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.3)
    return model


def roberta_classifier(**lora):
    from transformers import RobertaConfig, RobertaForSequenceClassification
    model = RobertaForSequenceClassification(RobertaConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=20, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1,
        num_labels=3))
    model = adapters_made_nonzero(apply_lora(lora_cfg("classifier", **lora), model))
    ids = torch.tensor([[0, 5, 6, 7, 8, 2], [0, 9, 10, 2, 1, 1], [0, 11, 2, 1, 1, 1]])
    batch = {"input_ids": ids, "attention_mask": (ids != 1).long(), "labels": torch.tensor([0, 2, 1])}

    def loss(m, b):
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        return F.cross_entropy(logits, b["labels"], reduction="none")
    return model, loss, batch


def llama_causal(**lora):
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True))
    model = adapters_made_nonzero(apply_lora(lora_cfg("causal", **{"target_modules": ["q_proj", "v_proj"], **lora}),
                                             model))
    ids = torch.tensor([[3, 5, 6, 7, 8, 9], [3, 10, 11, 12, 0, 0], [3, 13, 14, 0, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long()}

    def loss(m, b):
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
        target = b["input_ids"][:, 1:].masked_fill(b["attention_mask"][:, 1:] == 0, -100)
        return F.cross_entropy(logits.transpose(1, 2), target, reduction="none", ignore_index=-100).sum(1)
    return model, loss, batch


CASES = {"roberta-classifier": roberta_classifier, "llama-causal": llama_causal}


def test_only_the_adapters_and_the_classifier_head_are_trainable():
    model, _, _ = roberta_classifier()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or n.startswith("classifier.") for n in trainable)
    assert {n for n in trainable if n.startswith("classifier.")} == {
        "classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight", "classifier.out_proj.bias"}
    assert {n.split(".")[-4] for n in trainable if ".lora_" in n} == {"query", "value"}  # peft's roberta default
    model, _, _ = llama_causal()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}  # nothing else for a causal head
    assert type(model).__name__ == "LlamaForCausalLM"  # injected in place: still the transformers model


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_sample_gradients_of_the_adapters_match_a_loop(case, float64):
    torch.manual_seed(0)
    model, loss, batch = CASES[case]()
    got = engine_grads(model, loss, batch)
    assert_close(got, loop_grads(model, loss, batch, 3))
    assert all(g.abs().sum() > 0 for g in got.values())


@pytest.mark.parametrize("case", sorted(CASES))
def test_ghost_norms_of_the_adapters_match_a_loop(case, float64):
    torch.manual_seed(0)
    model, loss, batch = CASES[case]()
    want = sum(g.flatten(1).pow(2).sum(1) for g in loop_grads(model, loss, batch, 3).values())
    taps = Taps(model)
    kept = taps.gradients(lambda: loss(model, batch).sum(), 3, dict.fromkeys(taps.parameters, reducers.norms("ghost")))
    torch.testing.assert_close(sum(kept.values()), want, rtol=1e-8, atol=0)


def dp_cfg(**kw):
    return method_config("dp-adam", max_grad_norm=0.5, **kw)


@pytest.mark.parametrize("clipping", ["materialize", "ghost"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_coverage_check_passes_with_lora_dropout(case, clipping):
    """Dropout inside the adapters (p > 0, training mode): the rules see the dropped input, so the per-sample
    gradients still sum to autograd's batch gradient and the first step's coverage check (which raises) passes."""
    torch.manual_seed(0)
    model, loss, batch = CASES[case](dropout=0.3)
    model.train()
    method = build_method(dp_cfg(clipping=clipping), model, 1e-2, GaussianMechanism(1.0, 0.5, 3.0, seeded(0)))
    method.step([batch], loss)
    assert not method.privatizer._check_coverage  # it did run


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # peft on adapting a tied matrix
def test_an_adapter_no_rule_covers_is_an_error_naming_it():
    """peft's LoRA on an Embedding keeps its A and B as bare Parameters that its own forward uses: no layer rule
    sees them, so private training must refuse rather than leave them with noise alone."""
    model, _, _ = llama_causal(target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(ValueError, match=r"no per-sample rule covers model\.embed_tokens\.lora_embedding_A\.default"):
        build_method(dp_cfg(), model, 1e-2, GaussianMechanism(1.0, 0.5, 3.0, None))


def config(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=["train.batch_size=4", "logging.progress=false", "data=synthetic",
                                            "data.seq_len=8", "data.n_train=32", "model.lora.r=4", *overrides])


def test_hydra_list_overrides_choose_the_targets():
    cfg = config("model=llama-tiny", "model.lora.target_modules=[q_proj,v_proj]", "model.lora.alpha=16",
                 "model.lora.dropout=0.05", "model.lora.modules_to_save=[lm_head]")
    assert list(cfg.model.lora.target_modules) == ["q_proj", "v_proj"]
    model = build_model(cfg.model, build_data(cfg.data, cfg.model))
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.scaling["default"] == 16 / 4 and attn.v_proj.lora_dropout["default"].p == 0.05
    assert not hasattr(attn.k_proj, "lora_A")
    # the LM head is trained in place: still the one matrix it shares with the embeddings, not a copy
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.requires_grad


@pytest.mark.parametrize("model,override,key", [
    ("roberta-tiny", "model.lora.target_modules=[nothing_here]", "model.lora.target_modules"),
    ("vit-tiny", "data.image_size=8", "model.lora.target_modules.*no default for vit"),
    ("roberta-tiny", "model.lora.modules_to_save=[nothing_here]", "model.lora.modules_to_save"),
    ("roberta-tiny", "model.lora.r=0", "model.lora.r"),
    ("roberta-tiny", "model.lora.dropout=1.0", "model.lora.dropout"),
])
def test_bad_lora_options_name_the_key(model, override, key):
    cfg = config(f"model={model}", override)
    with pytest.raises(ConfigError, match=key):
        build_model(cfg.model, build_data(cfg.data, cfg.model))


@pytest.mark.parametrize("method", ["dp-adam", "grape", "dp-sgd-rc", "dpzero"])
def test_training_moves_only_the_adapters_and_the_head(method):
    probes = {"dp-sgd-rc": ["method.k=4"], "grape": ["method.rank=2"]}.get(method, [])  # grape: below LoRA's r=4
    cfg = config("model=roberta-tiny", f"method={method}", "method.max_grad_norm=1.0", *probes)
    torch.manual_seed(0)
    data = build_data(cfg.data, cfg.model)
    model = build_model(cfg.model, data).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n or n.startswith("classifier.") for n in trained)
    noise = GaussianMechanism(1.0, cfg.method.max_grad_norm, 4.0, seeded(0))
    step = build_method(cfg.method, model, 1e-2, noise, seed=0)
    for start in (0, 4, 8):
        step.step([{k: v[start:start + 4] for k, v in data.train.items()}], data.per_sample_loss)
    for n, p in model.named_parameters():
        if n in trained:
            assert not torch.equal(p, before[n]), f"{method}: {n} did not move"
        else:
            assert torch.equal(p, before[n]), f"{method}: frozen {n} changed"


@pytest.mark.parametrize("method", ["grape", "galore"])
def test_adapters_are_projected_only_below_their_rank(method):
    """A LoRA matrix, r×in or out×r, projected to rank >= r would be no smaller (and GaLore's SVD has only r
    directions to give): it is projected along its r side when method.rank < r. With rank >= r nothing that
    trains could be projected (the head stays whole), and the method is refused rather than run unprojected."""
    cfg = config("model=roberta-tiny", f"method={method}", "method.rank=4")
    data = build_data(cfg.data, cfg.model)
    noise = GaussianMechanism(1.0, 1.0, 4.0, seeded(0)) if method_class(method).spec.private else None
    with pytest.raises(ConfigError, match=r"method.rank: 4 is at least .* \(at most 4\).*allowed: 1..3"):
        build_method(cfg.method, build_model(cfg.model, data).train(), 1e-2, noise)
    cfg = config("model=roberta-tiny", f"method={method}", "method.rank=2")
    model = build_model(cfg.model, data).train()
    step = build_method(cfg.method, model, 1e-2, noise)
    sides = {n: step.sides.get(p) for n, p in model.named_parameters() if ".lora_" in n}
    assert set(sides.values()) == {0, 1}
    assert all(side == (0 if ".lora_A." in n else 1) for n, side in sides.items())
    step.step([{k: v[:4] for k, v in data.train.items()}], data.per_sample_loss)


def test_memory_planning_builds_the_adapters_on_meta():
    """The mlm head's task reads model.base_model and model.lm_head, which injection leaves as they were; the plan
    on meta matches the same steps on real tensors."""
    cfg = config("model=roberta-tiny", "model.head=mlm", "method=dp-adam", "memory.target=cpu", "memory.steps=2")
    meta, cpu = plan(cfg), plan(cfg, device="cpu")
    # the peak comes in the forward pass, where the task's label-word ids are copied to meta (not on cpu): 80 bytes
    assert 0 <= meta["peak_bytes"] - cpu["peak_bytes"] <= 80
    assert 0 < meta["trainable_parameters"] == 2 * 2 * (4 * 32 + 32 * 4) < meta["parameters"]  # q, v in 2 layers


def test_model_trainable_freezes_all_but_the_named_parameters():
    """The BillSum run of DP-SGD-RC (Efficient DP-SGD for LLMs with Randomized Clipping) trains Llama's last layers
    only: model.trainable patterns pick them; a step moves them and nothing else; patterns that match nothing are an
    error naming the key."""
    cfg = config("model=llama-tiny", "model.lora.r=null", "method=dp-adam", "method.max_grad_norm=1.0",
                 "model.trainable=[model.layers.1.*]")
    data = build_data(cfg.data, cfg.model)
    model = build_model(cfg.model, data).train()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in model.named_parameters() if n.startswith("model.layers.1.")}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = build_method(cfg.method, model, 1e-2, GaussianMechanism(1.0, 1.0, 4.0, seeded(0)))
    step.step([{k: v[:4] for k, v in data.train.items()}], data.per_sample_loss)
    assert {n for n, p in model.named_parameters() if not torch.equal(p, before[n])} == trained
    cfg = config("model=llama-tiny", "model.lora.r=null", "model.trainable=[encoder.*]")
    with pytest.raises(ConfigError, match="model.trainable: \\['encoder.\\*'\\] match no trainable parameter"):
        build_model(cfg.model, data)
