"""Book-keeping clipping (method.clipping=bk): one backward pass, exact norms from each linear-like layer's factors,
clipped sums (c ⊙ G)ᵀA; checked against the one-pass per-sample step and for the tensors it never makes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmem.methods import DPSGDRC, DPAdam, GaLoreDPNaive, method_config
from dpmem.persample import Taps, reducers
from dpmem.persample.factored import Factored
from dpmem.privacy.mechanism import GaussianMechanism
from helpers import (B, LargestTensor, Layers, layers_batch, layers_case, layers_loss, method_cfg, roberta_case,
                     run_steps, seeded, vit_case)


@pytest.mark.parametrize("make", [layers_case, roberta_case, vit_case], ids=["layers", "roberta", "vit"])
def test_a_bk_step_equals_a_materialize_step_given_the_same_noise(make):
    want = run_steps(make, DPAdam, method_cfg())
    assert not torch.equal(want, run_steps(make, DPAdam, method_cfg(), steps=1))  # the steps do move the model
    torch.testing.assert_close(run_steps(make, DPAdam, method_cfg(clipping="bk")), want, rtol=1e-9, atol=1e-10)


def test_galore_dp_naive_takes_bk():
    want = run_steps(layers_case, GaLoreDPNaive, method_cfg("galore-dp-naive"))
    torch.testing.assert_close(run_steps(layers_case, GaLoreDPNaive, method_cfg("galore-dp-naive", clipping="bk")),
                               want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("make", [layers_case, roberta_case], ids=["layers", "roberta"])
@pytest.mark.parametrize("estimator", ["hutch", "hutchpp"])
def test_dp_sgd_rc_with_bookkeeping_equals_its_two_passes(make, estimator):
    """The same probes give the same estimates and clip factors: one pass with the clipped sums from the factors
    must land where the paper's two passes do; both differ from exact clipping (k = 2 probes estimate coarsely)."""
    cfg = lambda **kw: method_config("dp-sgd-rc", max_grad_norm=0.5, optimizer="adam", estimator=estimator,  # noqa
                                     k=2, **kw)
    want = run_steps(make, DPSGDRC, cfg())
    torch.testing.assert_close(run_steps(make, DPSGDRC, cfg(bookkeeping=True)), want, rtol=1e-9, atol=1e-10)
    exact = run_steps(make, DPAdam, method_cfg(clipping="bk"))
    assert (want - exact).abs().max() > 1e-4


def test_a_factored_capture_keeps_linear_like_layers_factored_and_the_rest_dense():
    model, b = Layers().double(), layers_batch()
    with Taps(model) as taps:
        kept = taps.gradients(lambda: layers_loss(model, b).sum(), B, dict.fromkeys(taps.parameters, reducers.normed()))
        for m in (model.emb, model.conv, model.flat, model.tokens, model.gpt):
            assert isinstance(kept[m.weight][1], Factored), m
        assert all(isinstance(kept[m.bias][1], torch.Tensor) for m in (model.conv, model.flat, model.gpt))


@pytest.mark.parametrize("clipping", ["materialize", "bk"])
def test_bk_never_makes_a_per_sample_weight_gradient_of_a_wide_layer(clipping):
    """A 64×64 layer over 4 tokens: ghost norms (2·4² < 64·64) and the clipped sum as one 64×64 product, so nothing
    of B·64·64 elements exists; materialize makes exactly that (the oracle that the test can tell them apart)."""
    torch.manual_seed(0)
    batch_size, width = 8, 64
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))
    cfg = method_config("dp-sgd", max_grad_norm=1.0, check_coverage=False, clipping=clipping)
    method = DPAdam(model, cfg, 0.1, GaussianMechanism(1.0, 1.0, float(batch_size), seeded(0)))
    b = {"x": torch.randn(batch_size, 4, width), "y": torch.randint(0, 3, (batch_size,))}
    loss = lambda m, x: F.cross_entropy(m(x["x"]).mean(1), x["y"], reduction="none")  # noqa: E731
    with LargestTensor() as largest:
        method.step([b], loss)
    made = largest.numel >= batch_size * width * width
    assert made == (clipping == "materialize"), largest.numel
