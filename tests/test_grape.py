"""DP-GRAPE against references: projected per-sample gradients, one step from Algorithms 1–2, projector refresh,
and memory with the exact live-tensor counter."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmem.metering import LiveTensorCounter
from dpmem.methods import DPAdam, GaLoreDPNaive, Grape, method_config
from dpmem.persample import Projection, Taps, reducers
from dpmem.privacy.mechanism import GaussianMechanism
from helpers import Mixer, grape_cfg, mixer_batch, mixer_loss, seeded, standard_noise


def full_per_sample(model, b):
    with Taps(model) as taps:
        return taps.gradients(lambda: mixer_loss(model, b).sum(), len(b["y"]))


@pytest.mark.parametrize("layer,side", [("up", 1), ("down", 0), ("conv_wide", 0), ("conv_tall", 1)])
def test_projected_per_sample_gradients_equal_projected_explicit_ones(layer, side):
    torch.manual_seed(0)
    model, b = Mixer().double(), {k: (v.double() if v.is_floating_point() else v) for k, v in mixer_batch().items()}
    weight = getattr(model, layer).weight
    full = full_per_sample(model, b)[weight]
    P = torch.randn(weight.shape[side], 3, dtype=torch.float64)
    kept = Taps(model).gradients(lambda: mixer_loss(model, b).sum(), 6,
                                 {weight: reducers.projected(lambda: Projection(P, side))})
    want = torch.einsum("mr,bmn->brn", P, full) if side == 0 else full @ P
    got = kept[weight]
    assert got.shape == want.shape
    assert (got - want).norm() / want.norm() <= 1e-5
    assert Projection(P, side).project(full[0]).allclose(want[0])


def test_projected_sides_are_the_smaller_dimension():
    method = Grape(Mixer(), grape_cfg(), 1e-3, GaussianMechanism(1.0, 1.0, 6.0, None))
    names = {p: n for n, p in method.model.named_parameters()}
    sides = {names[p]: s for p, s in method.sides.items()}
    assert sides == {"up.weight": 1, "down.weight": 0, "conv_wide.weight": 0, "conv_tall.weight": 1}
    # the head is not projected by default, and P has N(0, 1/r) entries
    P = method.projection(method.model.down.weight, 1).P
    assert P.shape == (4, 2)
    big = Grape(nn.Sequential(nn.Linear(400, 300)), grape_cfg(rank=50, projected=["0"]), 1e-3,
                GaussianMechanism(1.0, 1.0, 6.0, None))
    assert big.projection(big.params[0], 1).P.var().item() == pytest.approx(1 / 50, rel=0.05)


def test_one_step_equals_algorithms_1_and_2():
    torch.manual_seed(0)
    model, b = Mixer(), mixer_batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sigma, C, expected, lr = 0.6, 0.5, 8.0, 0.01
    method = Grape(model, grape_cfg(C=C), lr, GaussianMechanism(sigma, C, expected, seeded(7)), seed=3)
    projections = {p: method.projection(p, 1) for p in method.sides}  # P for t = 1
    # reference: explicit per-sample gradients (independent of the projected rules), projected, clipped flat
    reference = Mixer()
    reference.load_state_dict(before)
    full = full_per_sample(reference, b)
    names = {p: n for n, p in model.named_parameters()}
    ref_params = dict(reference.named_parameters())
    per = {}
    for p in method.params:
        g = full[ref_params[names[p]]]
        per[p] = torch.stack([projections[p].project(gi) for gi in g]) if p in projections else g
    norms = torch.stack([g.reshape(6, -1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
    factors = torch.clamp(C / (norms + 1e-6), max=1.0)
    gen = seeded(7)
    method.step([b], mixer_loss)
    # noise drawn in the method's parameter order, in the projected shapes
    for p, noise in zip(method.params, standard_noise([per[p].shape[1:] for p in method.params], gen)):
        noisy = (torch.einsum("b,b...->...", factors, per[p]) + sigma * C * noise) / expected
        m, v = 0.1 * noisy, 0.001 * noisy ** 2
        alpha = lr * math.sqrt(1 - 0.999) / (1 - 0.9)
        update = m / (v.sqrt() + 1e-8)
        if p in projections:
            update = projections[p].lift(update)
        torch.testing.assert_close(p.detach(), before[names[p]] - alpha * update, rtol=1e-4, atol=1e-6)


def test_projector_is_the_same_in_backward_and_update_and_refreshes_every_f_steps():
    torch.manual_seed(0)
    model = Mixer()
    method = Grape(model, grape_cfg(refresh=3), 1e-3, GaussianMechanism(0.5, 1.0, 6.0, seeded(0)))
    seen = []
    real = method.projection

    def recording(p, t):
        proj = real(p, t)
        seen.append((t, p, proj.P.clone()))
        return proj

    method.projection = recording
    for _ in range(7):
        method.step([mixer_batch()], mixer_loss)
    weight = model.down.weight
    by_step = {}
    for t, p, P in seen:
        if p is weight:
            by_step.setdefault(t, []).append(P)
    assert sorted(by_step) == list(range(1, 8))
    for t, Ps in by_step.items():
        assert len(Ps) == (3 if t == 1 else 2)  # backward, update (and the first step's coverage check)
        assert all(torch.equal(Ps[0], P) for P in Ps)
    changes = [t for t in range(2, 8) if not torch.equal(by_step[t][0], by_step[t - 1][0])]
    assert changes == [3, 6]  # new seed whenever t mod F == 0


def test_grape_peak_is_well_below_dp_adam():
    """A tiny transformer whose linear layers dominate: per-sample gradients are B·d for dp-adam and
    B·r·Σ max(out, in) for grape."""
    from transformers import ViTConfig, ViTForImageClassification

    def peak(method_cls, cfg):
        torch.manual_seed(0)
        model = ViTForImageClassification(ViTConfig(
            image_size=8, patch_size=4, num_channels=1, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=256, num_labels=10))
        x = {"pixel_values": torch.randn(32, 1, 8, 8), "labels": torch.randint(0, 10, (32,))}
        loss = lambda m, b: F.cross_entropy(m(pixel_values=b["pixel_values"]).logits, b["labels"],  # noqa: E731
                                            reduction="none")
        method = method_cls(model, cfg, 1e-3, mechanism=GaussianMechanism(1.0, 1.0, 32.0, None))
        method.step([x], loss)
        with LiveTensorCounter().track_state(model, method) as counter:
            method.step([x], loss)
        return counter.peak

    dp = peak(DPAdam, method_config("dp-adam", max_grad_norm=1.0, clipping="materialize"))
    naive = peak(GaLoreDPNaive, grape_cfg(rank=4, name="galore-dp-naive"))
    grape = peak(Grape, grape_cfg(rank=4))
    assert grape < 0.35 * dp and grape < 0.35 * naive, (grape, dp, naive)


def test_per_sample_buffers_are_b_times_r_times_max_dimension():
    torch.manual_seed(0)
    model, rank = Mixer(), 2
    method = Grape(model, grape_cfg(rank=rank), 1e-3, GaussianMechanism(1.0, 1.0, 6.0, None))
    taps = method.privatizer.taps
    project = {p: reducers.projected(lambda p=p: method.projection(p, 1)) for p in method.sides}
    kept = taps.gradients(lambda: mixer_loss(model, mixer_batch()).sum(), 6, project)
    for p in method.sides:
        assert kept[p].numel() == 6 * rank * max(p.shape)  # never 6·out·in
