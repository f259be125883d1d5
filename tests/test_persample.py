"""Per-sample gradients against independent oracles: a loop of one-sample backward passes, and torch.func."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.pytorch_utils import Conv1D

from dpmem.persample import Taps, reducers
from helpers import assert_close, engine_grads, loop_grads
from tiny_models import tiny_opt, tiny_roberta, tiny_vit



pytestmark = pytest.mark.usefixtures("float64")  # oracles and engine agree to ~1e-12; the bound is 1e-5


class Wrap(nn.Module):
    def __init__(self, layer, head_in):
        super().__init__()
        self.layer, self.head = layer, nn.Linear(head_in, 3)

    def forward(self, x):
        return self.head(self.layer(x).flatten(1).tanh())


def mse_loss(model, batch):
    return (model(batch["x"]) - batch["y"]).pow(2).sum(1)


def with_direct_params():
    class Scale(nn.Module):  # a module the generic fallback must cover: direct parameters, no rule
        def __init__(self):
            super().__init__()
            self.cls = nn.Parameter(torch.randn(1, 1, 4))
            self.pos = nn.Parameter(torch.randn(1, 6, 4))

        def forward(self, x):
            return torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) * self.pos.exp()
    return Wrap(nn.Sequential(nn.Linear(4, 4), Scale()), 24), torch.randn(5, 5, 4)


CASES = {
    "linear-2d": lambda: (Wrap(nn.Linear(6, 4), 4), torch.randn(5, 6)),
    "linear-3d": lambda: (Wrap(nn.Linear(6, 4), 28), torch.randn(5, 7, 6)),
    "conv1d-hf": lambda: (Wrap(Conv1D(4, 6), 28), torch.randn(5, 7, 6)),
    "layernorm": lambda: (Wrap(nn.LayerNorm(6), 42), torch.randn(5, 7, 6) * 3 + 1),
    "layernorm-2d-shape": lambda: (Wrap(nn.LayerNorm((3, 6)), 18), torch.randn(5, 3, 6)),
    "conv2d": lambda: (Wrap(nn.Conv2d(3, 4, 3, stride=2, padding=1), 64), torch.randn(5, 3, 8, 8)),
    "conv2d-groups-dilation": lambda: (Wrap(nn.Conv2d(4, 6, 3, groups=2, dilation=2), 96), torch.randn(5, 4, 8, 8)),
    "conv2d-same-reflect": lambda: (Wrap(nn.Conv2d(2, 3, (3, 2), padding="same", padding_mode="reflect"), 75),
                                    torch.randn(5, 2, 5, 5)),
    "conv2d-same": lambda: (Wrap(nn.Conv2d(2, 3, 4, padding="same", bias=False), 48), torch.randn(5, 2, 4, 4)),
    "fallback-direct-params": with_direct_params,
    "fallback-groupnorm": lambda: (Wrap(nn.GroupNorm(2, 4), 36), torch.randn(5, 4, 3, 3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_rules_match_loop(case):
    torch.manual_seed(0)
    model, x = CASES[case]()
    batch = {"x": x, "y": torch.randn(x.shape[0], 3)}
    assert_close(engine_grads(model, mse_loss, batch), loop_grads(model, mse_loss, batch, x.shape[0]))


class InPlace(nn.Module):
    """In-place ops on a hooked layer's output, as Hugging Face models do (OPT scales its queries in place)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x)
        h *= 2.0
        h.tanh_()
        return self.b(h).sum(1)


class Copies(TorchDispatchMode):
    """Counts the copies and clones made inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.copy_.default, torch.ops.aten.clone.default)
        return func(*args, **(kwargs or {}))


def test_in_place_ops_on_a_layer_output_are_legal():
    torch.manual_seed(0)
    model, x = InPlace(), torch.randn(5, 7, 6)
    batch = {"x": x, "y": torch.randn(5, 3)}
    assert_close(engine_grads(model, mse_loss, batch), loop_grads(model, mse_loss, batch, 5))


def test_the_taps_make_the_backward_copy_no_gradient():
    """The backward makes no more copies with the taps than without (an in-place identity on each layer's output,
    a view of its matmul's 2-D result, made autograd clone and copy the output gradient per layer), streamed or
    not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    x, w = torch.randn(5, 7, 6), torch.randn(5, 7, 3)
    with Copies() as plain:
        (model(x) * w).sum().backward()
    for reduce in (lambda g: None, reducers.norms("ghost")):
        with Taps(model) as taps:
            with taps.recording(taps.zero(), 5, dict.fromkeys(taps.parameters, reduce)) as tape:
                loss = (model(x) * w).sum()
            with Copies() as copies:
                taps.per_sample(tape, loss)
        assert copies.count <= plain.count


def test_an_eager_step_streams_only_a_layer_whose_output_gradient_is_large(monkeypatch):
    """At the default STREAM_MIN_ELEMENTS (the suite streams every layer): the first Linear's output gradient
    (5·50·300 elements) streams, the second's (5·50·3) stays whole; both layers' squared norms equal a loop's."""
    from dpmem.persample import taps as taps_module

    monkeypatch.setattr(taps_module, "STREAM_MIN_ELEMENTS", 2**16)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 300), nn.Tanh(), nn.Linear(300, 3)).double()
    batch = {"x": torch.randn(5, 50, 6, dtype=torch.float64), "y": torch.randn(5, 50, 3, dtype=torch.float64)}
    want = {n: g.flatten(1).pow(2).sum(1) for n, g in loop_grads(model, mse_loss, batch, 5).items()}
    with Taps(model) as taps:
        with taps.recording(taps.zero(), 5, dict.fromkeys(taps.parameters, reducers.norms("ghost"))) as tape:
            loss = mse_loss(model, batch).sum()
        got, _ = taps.per_sample(tape, loss)
    assert tape.streamed == [True, False]
    names = {p: n for n, p in model.named_parameters()}
    assert_close({names[p]: v for p, v in got.items()}, want)


def test_embedding_with_padding_and_tied_head_matches_torch_func():
    torch.manual_seed(0)

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 4, padding_idx=0)
            self.mix = nn.Linear(4, 4)
            self.head = nn.Linear(4, 11, bias=False)
            self.head.weight = self.emb.weight  # tied: one parameter, two uses

        def forward(self, ids):
            return self.head(self.mix(self.emb(ids)).tanh())

    model = TiedLM()
    ids = torch.tensor([[1, 2, 2, 0], [3, 0, 0, 0], [4, 5, 6, 7]])
    labels = torch.tensor([[2, 3, 4, 5], [1, 1, 2, 2], [7, 6, 5, 4]])

    def loss(m, b):
        logits = m(b["ids"])
        return F.cross_entropy(logits.transpose(1, 2), b["labels"], reduction="none").sum(1)

    batch = {"ids": ids, "labels": labels}
    got = engine_grads(model, loss, batch)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p, i, lab):
        return loss(lambda x: functional_call(model, p, (x,)), {"ids": i[None], "labels": lab[None]}).sum()

    want = vmap(grad(one), in_dims=(None, 0, 0))(params, ids, labels)
    assert_close(got, want)
    # the tied matrix's per-sample gradient is the sum of both uses: the padding row gets only the head's part
    assert got["emb.weight"][:, 0].abs().sum() > 0


def test_unsupported_parameter_is_an_error_naming_it():
    """A container's parameters (a ParameterDict has no forward to replay) used by its parent's forward."""
    class Held(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.extra = nn.Linear(3, 3), nn.ParameterDict({"scale": nn.Parameter(torch.ones(3))})

        def forward(self, x):
            return self.lin(x) * self.extra["scale"]
    with pytest.raises(ValueError, match=r"no per-sample rule covers extra\.scale"):
        Taps(Held())


@pytest.mark.parametrize("frozen", [False, True])
def test_batch_norm_is_refused_frozen_or_not(frozen):
    """In training mode batch norm normalises each sample by the batch's statistics: a frozen one still mixes
    samples, so no per-sample clipping bounds a sample's influence."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model[1].requires_grad_(not frozen)
    with pytest.raises(ValueError, match=r"^1: BatchNorm1d mixes samples"):
        Taps(model)


def test_embedding_options_that_mix_samples_are_refused():
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        Taps(nn.Sequential(nn.Embedding(5, 3, scale_grad_by_freq=True)))


def test_fallback_refuses_active_dropout():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(x * self.w)

    model = Drop()
    taps = Taps(model)
    with taps.recording(taps.zero(), 2), pytest.raises(ValueError, match="dropout"):
        model(torch.randn(2, 3)).sum().backward()


@pytest.mark.parametrize("make", [tiny_roberta, tiny_vit, tiny_opt], ids=["roberta-mlm-tied", "vit", "opt"])
def test_hf_models_match_loop(make):
    torch.manual_seed(0)
    model, loss, batch = make()
    model.train()
    size = next(iter(batch.values())).shape[0]
    assert_close(engine_grads(model, loss, batch), loop_grads(model, loss, batch, size))


@pytest.mark.parametrize("clipping", ["materialize", "bk", "ghost"])
def test_a_layer_called_several_times_is_clipped_on_its_summed_gradient_in_every_step(clipping):
    """One Linear over 4 positions: streamed or not (the first step, with the coverage check, keeps every layer
    whole; later ones stream, find the repeated layer, and run the micro-batch again with it as pairs), every step
    equals a loop of one backward per sample, clipped by hand."""
    from dpmem.methods.clipping_plan import ClippingPlan
    from dpmem.methods.privatize import Privatizer
    from dpmem.privacy.mechanism import GaussianMechanism

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.norm = nn.Linear(6, 6), nn.LayerNorm(6)

        def forward(self, x):
            return sum(self.norm(self.linear(x[:, k])) for k in range(x.shape[1]))

    torch.manual_seed(0)
    model, x, y = Shared().double(), torch.randn(5, 4, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    loss_fn = lambda m, b: (m(b["x"]) - b["y"]).pow(2).sum(1)  # noqa: E731
    params = list(model.parameters())
    per_sample = [torch.autograd.grad(loss_fn(model, {"x": x[i:i + 1], "y": y[i:i + 1]}).sum(), params)
                  for i in range(5)]
    norms = torch.stack([torch.cat([g.flatten() for g in gs]).norm() for gs in per_sample])
    factors = (0.5 / (norms + 1e-6)).clamp(max=1.0)
    assert (factors < 1).any()
    want = [sum(f * gs[j] for f, gs in zip(factors, per_sample)) / 5 for j in range(len(params))]
    with Privatizer(model, GaussianMechanism(0.0, 0.5, 5.0, None), ClippingPlan.of(clipping)) as privatizer:
        for _ in range(3):
            got, _ = privatizer.gradient([{"x": x, "y": y}], loss_fn, {p: p.shape for p in params})
            for p, w in zip(params, want):
                torch.testing.assert_close(got[p], w, rtol=1e-9, atol=1e-12)
