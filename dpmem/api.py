"""dpmem's Python interface: what a training loop of your own needs, without the CLI.

- The private step: `Privatizer` (the privatised gradient of a model's trainable parameters, one logical step per
  call) with a `ClippingPlan` and the `Noise` it adds; or a whole method (`build_method(method_config(...), ...)`:
  DP-Adam, DP-GRAPE, DP-SGD-RC, DPZero and the rest, each with its own update).
- Sampling and secret randomness: `poisson_batches`, drawn from `Draws` keyed by `key_of` (256 bits of the OS's
  entropy, or a seed taken whole).
- Accounting: `calibrate_sigma` (the noise an ε needs) and `epsilon_spent` (the ε a run spent).
- Memory: `config` (a run's validated config, as `dpmem train` composes it from overrides), `plan` (its peak memory,
  planned on the meta device) and `largest_batch` (the largest batch under a budget).

`examples/private_loop.py` is a complete private training loop in plain PyTorch built on these."""

from __future__ import annotations

from omegaconf import DictConfig

from dpmem.data.bundle import Padded
from dpmem.engine.planner import largest_batch, plan
from dpmem.methods import build_method, method_config
from dpmem.methods.base import Method, Noise
from dpmem.methods.clipping import ClippingPlan
from dpmem.methods.privatize import PrivateGradient, Privatizer
from dpmem.privacy.accounting import calibrate_sigma, epsilon_spent
from dpmem.privacy.randomness import Draws, key_of
from dpmem.privacy.sampling import poisson_batches

__all__ = ["ClippingPlan", "Draws", "Method", "Noise", "Padded", "PrivateGradient", "Privatizer", "build_method",
           "calibrate_sigma", "config", "epsilon_spent", "key_of", "largest_batch", "method_config", "plan",
           "poisson_batches"]


def config(*overrides: str) -> DictConfig:
    """The validated config of one run, composed from `dpmem train`'s overrides (e.g. `config("model=opt-1.3b",
    "method=grape", "train.batch_size=8")`): what `plan` and `largest_batch` take. Raises
    `dpmem.config.ConfigError` naming the key of a bad override."""
    from dpmem.cli import compose_points  # the CLI's own composition and checks

    return compose_points([list(overrides)])[0]
