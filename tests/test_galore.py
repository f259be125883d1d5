"""GaLore and naive DP-GaLore: the SVD sees only the privatised gradient; a step follows Algorithm 4."""

import math

import torch

from dpmem.methods import GaLore, GaLoreDPNaive
import dpmem.methods.galore as galore_module
from dpmem.privacy.mechanism import GaussianMechanism
from helpers import Mixer, grape_cfg, mixer_batch, mixer_loss, seeded


def test_naive_dp_galore_svd_sees_only_the_privatised_gradient(monkeypatch):
    torch.manual_seed(0)
    model = Mixer()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    method = GaLoreDPNaive(model, grape_cfg(rank=2, refresh=2, name="galore-dp-naive"), 1e-3,
                           GaussianMechanism(1.0, 1.0, 6.0, seeded(0)))
    privatised, svd_inputs = [], []
    real_privatize, real_svd = method.privatizer.gradient, galore_module.svd_projection

    def spy_privatize(*args, **kwargs):
        grads, loss = real_privatize(*args, **kwargs)
        privatised.append({p: g.clone() for p, g in grads.items()})
        return grads, loss

    def spy_svd(g, side, rank):
        svd_inputs.append(g.clone())
        return real_svd(g, side, rank)

    method.privatizer.gradient = spy_privatize
    monkeypatch.setattr(galore_module, "svd_projection", spy_svd)
    for _ in range(3):
        method.step([mixer_batch()], mixer_loss)
    # SVDs at steps 1 (first) and 2 (t mod F = 0), one per projected layer, none at step 3
    assert len(svd_inputs) == 2 * len(method.sides)
    expected = [privatised[t][p] for t in (0, 1) for p in method.sides]
    assert all(torch.equal(a, b) for a, b in zip(svd_inputs, expected))
    # and the privatised gradient is not the clean one: noise of std sigma*C/(q n) was added
    reference = Mixer()
    reference.load_state_dict(initial)
    mixer_loss(reference, mixer_batch()).sum().backward()
    name = {p: n for n, p in model.named_parameters()}[next(iter(method.sides))]
    clean = dict(reference.named_parameters())[name].grad / 6.0
    assert (svd_inputs[0] - clean).abs().max() > 0.05


def test_galore_step_follows_algorithms_2_and_4():
    torch.manual_seed(0)
    model = Mixer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = grape_cfg(rank=2, refresh=5, name="galore")
    lr = 0.01
    method = GaLore(model, cfg, lr)
    b = mixer_batch()
    method.step([b], mixer_loss)
    reference = Mixer()
    reference.load_state_dict(before)
    mixer_loss(reference, b).mean().backward()
    alpha = lr * math.sqrt(1 - 0.999) / (1 - 0.9)
    names = {p: n for n, p in model.named_parameters()}
    ref = dict(reference.named_parameters())
    for p in method.params:
        g = ref[names[p]].grad
        if p in method.sides:
            side = method.sides[p]
            u, _, vh = torch.linalg.svd(g, full_matrices=False)
            P = u[:, :2] if side == 0 else vh[:2].T
            r = P.T @ g if side == 0 else g @ P
            update = (0.1 * r) / ((0.001 * r * r).sqrt() + 1e-8)
            update = P @ update if side == 0 else update @ P.T
        else:
            update = (0.1 * g) / ((0.001 * g * g).sqrt() + 1e-8)
        torch.testing.assert_close(p.detach(), before[names[p]] - alpha * update, rtol=1e-4, atol=1e-6)
