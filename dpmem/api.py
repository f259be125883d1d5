"""dpmem's Python interface: what a training loop of your own needs, without the CLI.

- The private step: `Privatizer` (the privatised gradient of a model's trainable parameters, one logical step per
  call) with a `ClippingPlan` and the `GaussianMechanism` that clips and noises; or a whole method
  (`build_method(method_config(...), ...)`: DP-Adam, DP-GRAPE, DP-SGD-RC, DPZero and the rest, each with its own
  update).
- Sampling and secret randomness: `poisson_batches`, drawn from `Draws` keyed by `key_of` (256 bits of the OS's
  entropy, or a seed taken whole).
- Accounting: `calibrate_sigma` (the noise an ε needs) and `epsilon_spent` (the ε a run spent), each with the
  accountant of the method (`accounting`: pld for most, DP-SGD-RC's rc with its probes and envelope).
- Memory: `config` (a run's validated config, as `dpmem train` composes it from overrides), `plan` (its peak memory,
  planned on the meta device) and `largest_batch` (the largest batch under a budget).
- One call for a loop of your own: `make_private(model, optimizer, data, loss_fn, batch_size=..., epsilon=...,
  epochs=...)` (Opacus' `make_private`): a `PrivateTraining` whose `step()` samples, privatises and steps the
  optimizer, and whose `epsilon` is what its steps spent; the model checked first, as `check` does.
- Your own model: `check(model, loss_fn, batch)` says which rule forms each parameter's per-sample gradients, runs
  the attribution proof under every clipping plan, and measures each plan's step memory (`print(check(...))`).

`examples/private_loop.py` is a complete private training loop in plain PyTorch built on these."""

from __future__ import annotations

from omegaconf import DictConfig

from dpmem.checking import Check, check
from dpmem.data.bundle import Padded
from dpmem.engine import planner
from dpmem.make_private import PrivateTraining, make_private
from dpmem.methods import build_method, method_config
from dpmem.methods.base import Method
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.privatize import PrivateGradient, Privatizer
from dpmem.privacy.accounting import calibrate_sigma, epsilon_spent
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, key_of
from dpmem.privacy.sampling import poisson_batches

__all__ = ["Check", "ClippingPlan", "Draws", "GaussianMechanism", "Method", "Padded", "PrivateGradient",
           "PrivateTraining", "Privatizer", "accounting", "build_method", "calibrate_sigma", "check", "config",
           "epsilon_spent", "key_of", "largest_batch", "make_private", "method_config", "plan", "poisson_batches"]


def accounting(method_cfg, model) -> dict:
    """The accountant a method's noise is calibrated and spent by, as keyword arguments of `calibrate_sigma` and
    `epsilon_spent`: {"accountant": "pld"} for most methods; DP-SGD-RC's randomized clipping needs its own (rc,
    with the probes k, the envelope's dimension for `model` and the estimator), as `dpmem train` uses. A method's
    noise calibrated by another accountant is not the ε it claims."""
    from dpmem.config import enum_value
    from dpmem.methods import method_class
    from dpmem.methods.rc import rc_dimension

    accountant = method_class(method_cfg.name).spec.accountant
    if accountant != "rc":
        return {"accountant": accountant}
    return {"accountant": "rc", "k": method_cfg.k, "d": rc_dimension(model, "model"),
            "estimator": enum_value(method_cfg.estimator)}


def config(*overrides: str) -> DictConfig:
    """The validated config of one run, composed from `dpmem train`'s overrides (e.g. `config("model=opt-1.3b",
    "method=grape", "train.batch_size=8")`): what `plan` and `largest_batch` take. Raises
    `dpmem.config.ConfigError` naming the key of a bad override."""
    from dpmem.composition import compose_points, sweep_points  # the CLI's own composition and checks

    for o in overrides:
        if not isinstance(o, str):
            raise TypeError(f"config: override {o!r} ({type(o).__name__}): allowed strings as on the command line, "
                            "e.g. config('train.batch_size=8')")
    sweep_points(list(overrides))  # a config group's unknown option refused with the options, as the CLI does
    return compose_points([list(overrides)])[0]


def _run_config(cfg, caller: str) -> DictConfig:
    """A run's config, as `config` makes it: a dict or a path would fail deep in the planner."""
    if not isinstance(cfg, DictConfig) or "train" not in cfg:
        raise TypeError(f"{caller}: cfg is {type(cfg).__name__}: allowed a run's config, "
                        "dpmem.api.config('model=...', ...)")
    return cfg


def plan(cfg: DictConfig, *args, **kwargs) -> dict:
    """The peak memory of a step of `cfg` (a config from `config`), its run planned on the meta device: no weights,
    no data. `dpmem.engine.planner.plan` takes the arguments (batch_size, physical_batch_size, device, ...) and says
    what the result holds; `plan(cfg)["peak_bytes"]` is the peak."""
    return planner.plan(_run_config(cfg, "plan"), *args, **kwargs)


def largest_batch(cfg: DictConfig, budget: int | str, limit: int = planner.SEARCH_LIMIT) -> tuple[int, dict | None]:
    """The largest batch of `cfg` (a config from `config`) up to `limit`, in one physical batch, whose run fits
    `budget` (bytes, or a size as memory.budget takes it: '24GB'), and its plan; (0, plan at 1) if not even one
    example fits (`dpmem.engine.planner.largest_batch`)."""
    return planner.largest_batch(_run_config(cfg, "largest_batch"), budget, limit)
