"""Two-pass clipping: per-sample norms from the first backward pass (fgc, ghost, mixed, Hutchinson, Hutch++)
against a loop of one backward per sample, and whole private steps against the one-pass (materialize) path."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmem.metering import LiveTensorCounter
from dpmem.methods import DPSGDRC, DPAdam, GaLoreDPNaive
from dpmem.persample import Taps
from dpmem.persample.factored import Factored
from dpmem.persample.norms import ghost_is_cheaper, hutchinson, squared_norms
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, seed_key
from helpers import (B, Layers, layers_batch, layers_case, layers_loss, method_cfg, roberta_case, run_steps, seeded,
                     vit_case)


def loop_squared_norms(model, b, loss=layers_loss):
    """The oracle: one backward per sample, the exact squared norm of each parameter's gradient."""
    out = {p: [] for p in model.parameters()}
    n = len(next(iter(b.values())))
    for i in range(n):
        model.zero_grad(set_to_none=True)
        loss(model, {k: v[i:i + 1] for k, v in b.items()}).sum().backward()
        for p in model.parameters():
            out[p].append(p.grad.pow(2).sum())
    model.zero_grad(set_to_none=True)
    return {p: torch.stack(v) for p, v in out.items()}


@pytest.mark.parametrize("rule", ["fgc", "ghost", "mixed"])
def test_exact_rules_equal_the_per_sample_loop(rule):
    torch.manual_seed(0)
    model, b = Layers().double(), layers_batch()
    want = loop_squared_norms(model, b)
    got, kinds = {}, {}
    taps = Taps(model)

    def record(p):
        def reduce(g):
            got[p], kinds[p] = squared_norms(g, rule), type(g)
            return got[p]
        return reduce

    kept = taps.gradients(lambda: layers_loss(model, b).sum(), B, {p: record(p) for p in taps.parameters})
    assert kinds[model.emb.weight] is Factored  # embedding + tied head: one factored gradient of two uses
    assert all(kinds[m.weight] is Factored for m in (model.conv, model.flat, model.tokens, model.gpt))
    assert set(got) == set(want)
    for p in want:
        torch.testing.assert_close(got[p], want[p], rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(sum(kept.values()), sum(want.values()), rtol=1e-5, atol=1e-12)
    assert all(v.shape == (B,) for v in kept.values())  # every per-sample gradient was freed once normed


def test_mixed_picks_the_cheaper_rule_per_layer():
    wide = Factored.outer(torch.zeros(2, 4, 64), torch.zeros(2, 4, 64))  # 2·4² < 64·64: ghost
    long = Factored.outer(torch.zeros(2, 64, 4), torch.zeros(2, 64, 4))  # 2·64² > 4·4: materialise
    assert ghost_is_cheaper(wide) and not ghost_is_cheaper(long)


def probe_case(rank_tokens=6):
    g = torch.Generator().manual_seed(3)
    left = torch.randn(3, rank_tokens, 20, generator=g, dtype=torch.float64)
    right = torch.randn(3, rank_tokens, 8, generator=g, dtype=torch.float64) * torch.tensor([1.0, 3.0, 0.3]).view(3, 1, 1)
    return Factored.outer(left, right)


@pytest.mark.parametrize("plus_plus", [False, True], ids=["hutch", "hutchpp"])
@pytest.mark.parametrize("transpose", [False, True], ids=["rows-larger", "cols-larger"])
def test_estimators_are_unbiased(plus_plus, transpose):
    g = probe_case()
    if transpose:
        (left, right), = g.terms
        g = Factored.outer(right, left)
    exact = g.squared_norms()
    gen = Draws(seed_key(0), "probes")
    draws = torch.stack([hutchinson(g, 4, gen, plus_plus) for _ in range(3000)])
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(len(draws))
    assert ((mean - exact).abs() < 3 * se).all(), (mean, exact, se)
    assert (draws.std(0) > 1e-3 * exact).all()  # genuinely random (not the exact value)


def test_hutchpp_has_lower_variance_on_a_low_rank_case():
    g = probe_case(rank_tokens=3)  # rank ≤ 3 < k: Hutch++'s sketch captures the whole range
    gen = Draws(seed_key(0), "probes")
    hutch = torch.stack([hutchinson(g, 4, gen) for _ in range(500)])
    hutchpp = torch.stack([hutchinson(g, 4, gen, plus_plus=True) for _ in range(500)])
    assert (hutchpp.var(0) < 1e-3 * hutch.var(0)).all()


def test_estimators_on_ids_and_tied_terms_are_unbiased():
    torch.manual_seed(0)
    model, b = Layers().double(), layers_batch()
    taps = Taps(model)
    tied = {}

    def keep(p):
        def reduce(g):
            tied[p] = g
            return squared_norms(g, "ghost")
        return reduce

    taps.gradients(lambda: layers_loss(model, b).sum(), B, {p: keep(p) for p in taps.parameters})
    g = tied[model.emb.weight]
    assert len(g.terms) == 2 and g.terms[0][0].dim() + g.terms[1][0].dim() == 5  # ids (2-D) and dense (3-D)
    exact = loop_squared_norms(model, b)[model.emb.weight]
    gen = Draws(seed_key(1), "probes")
    for plus_plus in (False, True):
        draws = torch.stack([hutchinson(g, 2, gen, plus_plus) for _ in range(2000)])  # k < rank 6
        se = draws.std(0) / math.sqrt(len(draws))
        assert ((draws.mean(0) - exact).abs() < 3 * se).all()


@pytest.mark.parametrize("make", [layers_case, roberta_case, vit_case], ids=["layers", "roberta", "vit"])
@pytest.mark.parametrize("clipping", ["fgc", "ghost", "mixed"])
def test_a_two_pass_step_equals_a_materialize_step_given_the_same_noise(make, clipping):
    want = run_steps(make, DPAdam, method_cfg())
    got = run_steps(make, DPAdam, method_cfg(clipping=clipping))
    assert not torch.equal(want, run_steps(make, DPAdam, method_cfg(), steps=1))  # the steps do move the model
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("clipping", ["ghost", "hutch"])
def test_the_first_pass_forms_no_batch_gradient_after_the_coverage_check(clipping):
    """Only the second pass (autograd's Σᵢ fᵢ gᵢ) forms the parameters' gradients, once per micro-batch; the first
    step's first pass also forms the batch gradient that the coverage check compares with."""
    torch.manual_seed(0)
    model, loss, b = roberta_case()
    cls, cfg = (DPAdam, method_cfg(clipping=clipping)) if clipping == "ghost" else (DPSGDRC, method_cfg("dp-sgd-rc"))
    method = cls(model, cfg, lr=0.05, mechanism=GaussianMechanism(1.0, 0.5, 3.0, seeded(7)))
    params = [p for p in model.parameters() if p.requires_grad]
    accumulated = []
    handles = [p.register_hook(lambda g: accumulated.append(g)) for p in params]
    micro = [{k: v[i::2] for k, v in b.items()} for i in range(2)]
    counts = []
    for _ in range(2):
        method.step(micro, loss)
        counts.append(len(accumulated))
        accumulated.clear()
    for h in handles:
        h.remove()
    # step 1: the checked first pass, then two second passes; step 2: the second passes only
    assert counts == [3 * len(params), 2 * len(params)]
    assert all(p.grad is None for p in params)  # every gradient returned as a value


def test_galore_dp_naive_takes_the_clipping_option():
    want = run_steps(layers_case, GaLoreDPNaive, method_cfg("galore-dp-naive"))
    torch.testing.assert_close(run_steps(layers_case, GaLoreDPNaive, method_cfg("galore-dp-naive", clipping="ghost")),
                               want, rtol=1e-9, atol=1e-10)


def test_rc_with_many_probes_approaches_exact_clipping():
    """With k large the estimates concentrate on the exact norms, so the RC step tends to the exact step
    (noise off: the probes come from the noise generator, so noisy steps would differ in their noise draws)."""
    def step(cls, cfg, steps=1):
        return run_steps(layers_case, cls, cfg, steps=steps, sigma=0.0)
    want, start = step(DPAdam, method_cfg(optimizer="sgd")), step(DPAdam, method_cfg(optimizer="sgd"), 0)
    errors = [(step(DPSGDRC, method_cfg("dp-sgd-rc", "sgd", k=k)) - want).norm() / (want - start).norm()
              for k in (2, 2000)]
    assert errors[1] < 0.1 < errors[0], errors


def peak(clipping, layer, tokens):
    torch.manual_seed(0)
    model = nn.Sequential(layer, nn.Flatten(), nn.LazyLinear(2))
    b = {"x": torch.randn(4, tokens, layer.in_features), "y": torch.tensor([0, 1, 0, 1])}
    loss = lambda m, x: F.cross_entropy(m(x["x"]), x["y"], reduction="none")  # noqa: E731
    model(b["x"])  # materialise the lazy head
    cfg = method_cfg(optimizer="sgd", clipping=clipping)
    cfg.check_coverage = False
    method = DPAdam(model, cfg, lr=0.1, mechanism=GaussianMechanism(1.0, 0.5, 4.0, None))
    with LiveTensorCounter().track_state(model, method) as counter:
        method.step([b], loss)
    return counter.peak


def test_memory_ghost_wins_for_wide_layers_and_short_inputs_mixed_is_never_worse():
    wide = lambda: nn.Linear(256, 256, bias=False)  # noqa: E731
    materialize, fgc, ghost, mixed = (peak(c, wide(), tokens=2) for c in ("materialize", "fgc", "ghost", "mixed"))
    assert ghost < fgc <= materialize and mixed <= ghost
    narrow = lambda: nn.Linear(4, 4, bias=False)  # noqa: E731
    fgc, ghost, mixed = (peak(c, narrow(), tokens=128) for c in ("fgc", "ghost", "mixed"))
    assert fgc < ghost and mixed <= fgc  # (mixed also ghosts the head, 2 x 512 at T = 1)
