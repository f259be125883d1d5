"""The layers users bring that no factored rule covers, replayed per sample (`dpmem.persample.fallback`):
nn.MultiheadAttention (batch first or not, bias and bias_kv), nn.LSTM, nn.GRU and nn.RNN (multi-layer,
bidirectional, batch first or not), nn.TransformerEncoder either way and torchvision's VisionTransformer: the clipped
sum of every plan against a loop of one-sample backward passes, and what cannot be split refused naming it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmem.methods import build_method, method_config
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.privatize import Privatizer
from dpmem.privacy.mechanism import GaussianMechanism
from helpers import loop_grads, seeded

PLANS = ["materialize", "bk", "ghost", "mixed", "fgc"]
B, T = 4, 5


pytestmark = pytest.mark.usefixtures("float64")


class Sequence(nn.Module):
    """Token ids -> embedding -> `layer` (seq-first where not batch_first) -> mean over time -> linear head."""

    def __init__(self, layer, width, batch_first, attention=False):
        super().__init__()
        self.emb, self.layer, self.head = nn.Embedding(20, 8), layer, nn.Linear(width, 3)
        self.batch_first, self.attention = batch_first, attention

    def forward(self, ids):
        x = self.emb(ids if self.batch_first else ids.T)
        out = self.layer(x, x, x)[0] if self.attention else self.layer(x)
        out = out[0] if isinstance(out, tuple) else out
        return self.head(out.mean(1 if self.batch_first else 0))


def encoder(batch_first):
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
    return Sequence(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), 8, batch_first)


def vision_transformer():
    from torchvision.models import VisionTransformer
    return VisionTransformer(image_size=8, patch_size=4, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16,
                             num_classes=3)


MODELS = {
    "mha-batch-first": lambda: Sequence(nn.MultiheadAttention(8, 2, batch_first=True), 8, True, attention=True),
    "mha-seq-first-bias-kv": lambda: Sequence(nn.MultiheadAttention(8, 2, add_bias_kv=True), 8, False, attention=True),
    "mha-no-bias": lambda: Sequence(nn.MultiheadAttention(8, 2, bias=False, batch_first=True), 8, True, attention=True),
    "lstm-2-layers-bidirectional": lambda: Sequence(nn.LSTM(8, 5, num_layers=2, bidirectional=True,
                                                            batch_first=True), 10, True),
    "gru-seq-first": lambda: Sequence(nn.GRU(8, 5), 5, False),
    "rnn": lambda: Sequence(nn.RNN(8, 5, batch_first=True), 5, True),
    "transformer-encoder": lambda: encoder(True),
    "transformer-encoder-seq-first": lambda: encoder(False),
    "torchvision-vit": vision_transformer,
}


def batch(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 3, 8, 8, generator=g) if name == "torchvision-vit" else torch.randint(0, 20, (B, T), generator=g)
    return {"x": x, "y": torch.randint(0, 3, (B,), generator=g)}


def loss(m, b):
    return F.cross_entropy(m(b["x"]), b["y"], reduction="none")


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", MODELS)
def test_the_clipped_sum_equals_a_loop_of_one_sample_backward_passes(name, plan):
    torch.manual_seed(0)
    model, data = MODELS[name](), batch(name)
    per = loop_grads(model, loss, data, B)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
    C = float(norms.median())
    factors = (C / (norms + 1e-6)).clamp(max=1.0)
    names = {p: n for n, p in model.named_parameters()}
    with Privatizer(model, GaussianMechanism(0.0, C, 1.0, seeded(0)), ClippingPlan.of(plan)) as privatize:
        got, _ = privatize.gradient([data], loss, {p: p.shape for p in privatize.params})
    assert {names[p] for p in got} == set(per)
    for p, g in got.items():
        want = torch.einsum("b,b...->...", factors, per[names[p]])
        assert (g - want).norm() <= 1e-9 * want.norm().clamp_min(1e-9), names[p]


@pytest.mark.parametrize("name", ["mha-seq-first-bias-kv", "lstm-2-layers-bidirectional", "transformer-encoder"])
def test_grape_releases_the_sum_of_its_samples_releases(name):
    """DP-GRAPE projects the Linear weights (out_proj inside an attention layer stays dense: its forward never
    calls it) and releases, for a batch, the sum of what it releases for each sample alone from the same start."""
    def release(samples):
        torch.manual_seed(0)
        model = MODELS[name]()
        method = build_method(method_config("grape", rank=2, max_grad_norm=0.3), model, 0.0,
                              GaussianMechanism(0.0, 0.3, 1.0, seeded(3)))
        part = {k: v[samples] for k, v in batch(name).items()}
        out, _ = method.privatizer.gradient([part], loss, method.shapes, method._projections(1))
        return torch.cat([g.flatten() for g in out.values()])

    torch.testing.assert_close(release(list(range(B))), sum(release([i]) for i in range(B)), rtol=1e-8, atol=1e-10)


class Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)

    def forward(self, x):
        packed = nn.utils.rnn.pack_padded_sequence(x, [T] * B, batch_first=True)
        return nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)[0].sum((1, 2))


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(3, 1, batch_first=True)

    def forward(self, x):
        return self.att(x, x, x, attn_mask=torch.zeros(B, T, T))[0].sum((1, 2))


@pytest.mark.parametrize("make, words", [
    (Packed, r"rnn: LSTM fed a PackedSequence.*pad the batch"),
    (lambda: nn.Sequential(nn.GRU(3, 4, num_layers=2, dropout=0.5, batch_first=True)), r"0: GRU's dropout between "
     r"layers \(p=0\.5\).*set dropout=0"),
    (Masked, r"att: a 3-D attn_mask holds B·heads rows"),
])
def test_what_a_replay_cannot_split_is_refused_naming_the_layer(make, words):
    model = make()
    forward = (lambda m, b: m(b["x"])[0].sum((1, 2))) if isinstance(model, nn.Sequential) else lambda m, b: m(b["x"])
    with Privatizer(model, GaussianMechanism(0.0, 1.0, 1.0, seeded(0)), ClippingPlan.of("bk")) as privatize:
        with pytest.raises(ValueError, match=words):
            privatize.gradient([{"x": torch.randn(B, T, 3)}], forward, {p: p.shape for p in privatize.params})


def counted_peak(name, plan, device):
    """The live-tensor counter's peak over two dp-adam steps (the second holds Adam's moments) on `device`, with the
    planner's attention routing (meta's scaled_dot_product_attention takes the CPU's kernel, as `dpmem memory`
    plans it)."""
    from dpmem.engine.planner import AttentionKernels, UnknownValues
    from dpmem.metering import LiveTensorCounter
    torch.manual_seed(0)
    with torch.device(device):
        model = MODELS[name]()
    data = {k: v.to(device) for k, v in batch(name).items()}
    method = build_method(method_config("dp-adam", clipping=plan, max_grad_norm=1.0), model, 0.1,
                          GaussianMechanism(1.0, 1.0, float(B), None))
    with AttentionKernels("cpu"), UnknownValues(), LiveTensorCounter().track_state(model, method) as counter:
        for _ in range(2):
            method.step([data], loss)
    method.close()
    return counter.peak


# a batch-first RNN under two-pass clipping: the CPU kernel's backward holds a time-major copy of its (B·T, in)
# input at the peak, which meta's kernel does not (1.7% of this step's peak; docs/models.md, Not yet)
SHORT_ON_META = pytest.mark.xfail(strict=True, reason="a batch-first RNN's CPU backward holds a time-major input copy")


@pytest.mark.parametrize("name, plan", [
    pytest.param(n, plan, marks=SHORT_ON_META if plan == "ghost" and n in ("lstm-2-layers-bidirectional", "rnn")
                 else ()) for n in MODELS for plan in ("bk", "ghost")])
def test_a_replayed_layers_step_holds_on_meta_the_bytes_it_holds_on_cpu(name, plan):
    """What `dpmem memory` plans for a replayed layer (its dense B × parameters per-sample gradients, and the
    replay's activations) is what a real step holds: the same steps on meta and on CPU tensors, counted. The
    attention inside nn.MultiheadAttention (nn.TransformerEncoder's, torchvision's ViT's) takes the CPU's kernel on
    meta too (it took the math path, and the plan was 10-18% over)."""
    assert counted_peak(name, plan, "meta") == counted_peak(name, plan, "cpu") > 0
