"""DPZero and MeZO: restoration, unbiasedness on a quadratic, clipping, noise, reproducibility, memory."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from dpmem.metering import LiveTensorCounter
from dpmem.methods import Adam, DPZero, MeZO, method_config
from dpmem.privacy.mechanism import GaussianMechanism
from tiny_models import tiny_vit
from helpers import seeded



def zo_cfg(direction="gaussian", zo_eps=1e-3):
    return method_config("dpzero", zo_eps=zo_eps, direction=direction, max_grad_norm=1.0)


class Quadratic(nn.Module):
    """Lᵢ(θ) = ½‖A θ − xᵢ‖²: central differences are exact, the true gradient is closed-form."""

    def __init__(self, dim=6):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.theta = nn.Parameter(torch.randn(dim, generator=g))
        self.register_buffer("A", torch.randn(dim, dim, generator=g) / dim ** 0.5)

    def forward(self, x):
        return 0.5 * (self.theta @ self.A.T - x).pow(2).sum(-1)


def quad_loss(model, batch):
    return model(batch["x"])


def test_step_with_zero_lr_restores_the_parameters():
    torch.manual_seed(0)
    model, loss, batch = tiny_vit()
    before = [p.detach().clone() for p in model.parameters()]
    method = DPZero(model, zo_cfg(), lr=0.0, mechanism=GaussianMechanism(1.0, 1.0, 3.0, seeded(0)), seed=3)
    for _ in range(3):
        method.step([batch], loss)
    for a, p in zip(before, model.parameters()):
        assert (p.detach() - a).norm() <= 1e-6 * a.norm()


def test_both_passes_take_the_same_dropout_masks():
    """Under a fixed dropout mask this loss is linear in θ, so its central difference is exact whatever λ; with
    other masks in L⁻ than in L⁺ the estimate would be the masks' difference over 2λ instead."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5)).train()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    estimates = []
    for zo_eps in (1e-3, 1e-1):
        torch.manual_seed(0)
        method = MeZO(model, zo_cfg(zo_eps=zo_eps), lr=0.0)
        estimates.append(method.per_sample_estimates(1, [{"x": x}], lambda m, b: m(b["x"]).sum(1))[0])
    torch.testing.assert_close(estimates[0], estimates[1], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("direction", ["gaussian", "sphere"])
def test_zeroth_order_estimates_average_to_the_true_gradient(direction):
    model = Quadratic()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    theta = model.theta.detach().clone().requires_grad_(True)
    true_grad, = torch.autograd.grad(0.5 * (theta @ model.A.T - x).pow(2).sum(-1).mean(), theta)
    method = MeZO(model, zo_cfg(direction), lr=0.0)
    samples = []
    for seed in range(3000):
        estimates, _ = method.per_sample_estimates(seed, [{"x": x}], quad_loss)
        z = next(method._directions(seed))[1]
        samples.append(estimates.mean() * z)
    samples = torch.stack(samples)
    mean, se = samples.mean(0), samples.std(0) / len(samples) ** 0.5
    assert ((mean - true_grad).abs() <= 3 * se).all(), (mean, true_grad, se)
    if direction == "sphere":
        z = next(method._directions(7))[1]
        assert z.norm().item() == pytest.approx(6 ** 0.5, rel=1e-5)


def test_clipping_bounds_each_sample_and_noise_has_std_sigma_c():
    method = DPZero(Quadratic(), zo_cfg(), lr=0.0, mechanism=GaussianMechanism(0.0, 1.0, 4.0, None))
    # clip each scalar to [-C, C], sum, divide by the expected batch size
    assert float(method.aggregate(torch.tensor([5.0, -7.0, 0.25]))) == pytest.approx((1 - 1 + 0.25) / 4)
    sigma, C, expected = 2.0, 0.5, 4.0
    method.mechanism = GaussianMechanism(sigma, C, expected, seeded(0))
    draws = torch.stack([method.aggregate(torch.zeros(0)) for _ in range(4000)])
    # the sample std of 4000 normal draws is within 5% of the truth with overwhelming probability
    assert float(draws.std()) == pytest.approx(sigma * C / expected, rel=0.05)
    assert abs(float(draws.mean())) < 4 * sigma * C / expected / 4000 ** 0.5


def test_a_fixed_seed_reproduces_a_run_exactly(tmp_path):
    from helpers import config
    from dpmem.engine.trainer import run_training
    runs = []
    for name in ("a", "b"):
        run_training(config("method=dpzero", "privacy.noise_seed=5", "privacy.sampler_seed=5", "train.seed=3"),
                     tmp_path / name)
        runs.append([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
    losses = [[r.get("loss") for r in run] for run in runs]
    assert losses[0] == losses[1] and None not in losses[0][:-1]
    assert runs[0][-1]["accuracy"] == runs[1][-1]["accuracy"]


def test_dpzero_peak_is_a_forward_pass_and_far_below_adam():
    def peak(run):
        torch.manual_seed(0)
        model, loss, batch = tiny_vit()
        return run(model, loss, batch)

    def forward_only(model, loss, batch):
        with LiveTensorCounter().track_state(model) as c, torch.no_grad():
            loss(model, batch)
        return c.peak

    def dpzero(model, loss, batch):
        method = DPZero(model, zo_cfg(), 1e-3, mechanism=GaussianMechanism(1.0, 1.0, 3.0, None), seed=0)
        with LiveTensorCounter().track_state(model) as c:
            for _ in range(2):
                method.step([batch], loss)
        return c.peak

    def adam(model, loss, batch):
        method = Adam(model, OmegaConf.create({"optimizer": "adam", "betas": [0.9, 0.999], "eps": 1e-8,
                                               "weight_decay": 0.0}), 1e-3)
        method.step([batch], loss)  # creates the moments
        with LiveTensorCounter().track_state(model, method) as c:
            method.step([batch], loss)
        return c.peak

    fwd, zo, ad = peak(forward_only), peak(dpzero), peak(adam)
    assert zo <= 1.2 * fwd, (zo, fwd)
    assert zo < ad / 2, (zo, ad)
