"""Training methods, one file each. `build_method` maps the config's method name to its class."""

from __future__ import annotations

from typing import Sequence

from omegaconf import OmegaConf

from dpmem.config import ConfigError, validate_groups
from dpmem.methods.adam import Adam
from dpmem.methods.base import Method
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.methods.dp_adam import DPAdam
from dpmem.methods.dpzero import DPZero, MeZO
from dpmem.methods.galore import GaLore, GaLoreDPNaive
from dpmem.methods.grape import Grape
from dpmem.methods.privatize import Observer
from dpmem.methods.rc import DPSGDRC
from dpmem.methods.subspace import SubspaceProjection

METHODS = {"adam": Adam, "dp-adam": DPAdam, "dp-sgd": DPAdam, "mezo": MeZO, "dpzero": DPZero,
           "grape": Grape, "galore": GaLore, "galore-dp-naive": GaLoreDPNaive, "dp-sgd-rc": DPSGDRC}


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise ConfigError("method.name", f"{name!r} is unknown; allowed: {', '.join(METHODS)}")
    return METHODS[name]


def validate(cfg) -> None:
    """Every check of a run config that its types cannot express: each group's (dpmem.config.validate_groups),
    then what the method's class requires of the whole config (Method.check). Raises ConfigError."""
    cls = method_class(cfg.method.name)  # an unknown method is reported first
    validate_groups(cfg)
    cls.check(cfg)


def method_config(name: str, **options):
    """The config of method `name` with its schema's defaults, e.g. method_config("grape", rank=4) in Python."""
    return OmegaConf.merge(OmegaConf.structured(method_class(name).config), {"name": name, **options})


def build_method(cfg, model, lr: float, mechanism: GaussianMechanism | None, seed: int = 0,
                 observers: Sequence[Observer] = ()) -> Method:
    """The method of `cfg`; `observers` see its private step (dpmem.methods.privatize.Observer). Subspace re-training's
    projection (method.subspace.path) is the innermost one: they see the clipped sums before it projects them, and
    the release after."""
    cls = method_class(cfg.name)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{cfg.name}: the model has no trainable parameter (every one has requires_grad=False): "
                         "nothing to train")
    if observers and not cls.private:
        raise ConfigError("method.name", f"{cfg.name} is not private: it has no privatised quantity to observe")
    if cls.privatised_gradient and cfg.subspace.path is not None:
        observers = (*observers, SubspaceProjection(cfg.subspace, model))
    return cls(model, cfg, lr, mechanism=mechanism, seed=seed, observers=observers)


__all__ = ["build_method", "method_class", "method_config", "validate", "Method", "METHODS", "Adam",
           "DPAdam", "MeZO", "DPZero", "Grape", "GaLore", "GaLoreDPNaive", "DPSGDRC"]
