"""A differentially private training loop in plain PyTorch, with dpmem's private step (`dpmem.api`).

An MLP on scikit-learn's bundled digits (1,797 8×8 images, offline), trained at (ε, δ) = (8, 1e-5):
Poisson-sampled batches from a secret key, σ calibrated to ε by the PLD accountant, per-sample clipping by
book-keeping (bk) and the Gaussian noise of `Privatizer`, then any torch optimiser. `--method grape` runs a whole
dpmem method (DP-GRAPE: projected per-sample gradients and its own Adam) on the same loop instead, its σ calibrated
and its ε spent by the method's own accountant (`dpmem.api.accounting`: rc for dp-sgd-rc).

    python examples/private_loop.py                       # Privatizer + torch.optim.Adam
    python examples/private_loop.py --method grape        # dpmem's DP-GRAPE step
    python examples/private_loop.py --seed 3              # reproducible batches and noise (not secret)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from dpmem.api import (ClippingPlan, Draws, GaussianMechanism, Privatizer, accounting, build_method, calibrate_sigma,
                       epsilon_spent, key_of, method_config, poisson_batches)


def per_sample_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One loss per sample (reduction="none"): dpmem clips each sample's gradient, so it needs them apart."""
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def train(steps: int = 100, batch_size: int = 64, epsilon: float = 8.0, delta: float = 1e-5, max_grad_norm: float = 1.0,
          lr: float = 5e-3, method: str | None = None, seed: int | None = None) -> dict:
    """Train privately; returns ε spent, σ and the held-out accuracy."""
    images, labels = load_digits(return_X_y=True)
    x, y = torch.tensor(images, dtype=torch.float32) / 16, torch.tensor(labels)
    n = 1500  # the first 1,500 images are the private training set; the rest are held out
    torch.manual_seed(0)  # the initial weights (public): not the secret randomness below
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))

    q = batch_size / n  # each record joins each step with probability q
    method_cfg = method_config(method, max_grad_norm=max_grad_norm) if method is not None else None
    account = accounting(method_cfg, model) if method_cfg is not None else {"accountant": "pld"}
    sigma = calibrate_sigma(epsilon, delta, q, steps, **account)  # the noise multiplier ε needs after `steps` steps
    key = key_of(seed)  # 256 bits of the OS's entropy (seed=None), or a user's seed taken whole
    noise = GaussianMechanism(sigma, max_grad_norm, expected_batch_size=q * n, draws=Draws(key, "noise"))
    batches = poisson_batches(n, q, steps, Draws(key, "batches"))  # sizes vary, and may be 0

    if method is None:  # the private gradient, then an optimiser of your own
        privatize = Privatizer(model, noise, ClippingPlan.of("bk"))
        optimizer = torch.optim.Adam(privatize.params, lr=lr)
        shapes = {p: p.shape for p in privatize.params}
        for index in batches:
            micro = [{"x": x[index], "y": y[index]}] if len(index) else []  # an empty batch is noise alone
            grads, _ = privatize.gradient(micro, per_sample_loss, shapes)  # Σ clipped + N(0, σ²C²), over q·n
            for p in privatize.params:
                p.grad = grads[p]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        privatize.close()  # removes its hooks from the model
    else:  # a whole dpmem method: its private step and its update
        step = build_method(method_cfg, model, lr, noise)
        for index in batches:
            step.step([{"x": x[index], "y": y[index]}] if len(index) else [], per_sample_loss)
        step.close()

    with torch.no_grad():
        accuracy = (model(x[n:]).argmax(1) == y[n:]).float().mean().item()
    return {"epsilon": epsilon_spent(sigma, delta, q, steps, **account), "sigma": sigma, "accuracy": accuracy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--method", default=None, help="a dpmem method (grape, dp-adam, dp-sgd-rc, ...) instead of "
                                                   "Privatizer + torch.optim.Adam")
    ap.add_argument("--seed", type=int, default=None, help="reproducible batches and noise (default: OS entropy)")
    args = ap.parse_args()
    out = train(steps=args.steps, method=args.method, seed=args.seed)
    print(f"epsilon {out['epsilon']:.3f} (sigma {out['sigma']:.3f}), held-out accuracy {out['accuracy']:.3f}")


if __name__ == "__main__":
    main()
