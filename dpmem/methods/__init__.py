"""Training methods, one file each. `build_method` maps the config's method name to its class."""

from __future__ import annotations

from omegaconf import OmegaConf

from dpmem.config import ConfigError
from dpmem.methods.adam import Adam
from dpmem.methods.base import Method, Noise
from dpmem.methods.dp_adam import DPAdam
from dpmem.methods.dpzero import DPZero, MeZO
from dpmem.methods.galore import GaLore, GaLoreDPNaive
from dpmem.methods.grape import Grape
from dpmem.methods.rc import DPSGDRC
from dpmem.methods.subspace import SubspaceProjection

METHODS = {"adam": Adam, "dp-adam": DPAdam, "dp-sgd": DPAdam, "mezo": MeZO, "dpzero": DPZero,
           "grape": Grape, "galore": GaLore, "galore-dp-naive": GaLoreDPNaive, "dp-sgd-rc": DPSGDRC}


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise ConfigError("method.name", f"{name!r} is unknown; allowed: {', '.join(METHODS)}")
    return METHODS[name]


def method_config(name: str, **options):
    """The config of method `name` with its schema's defaults, e.g. method_config("grape", rank=4) in Python."""
    return OmegaConf.merge(OmegaConf.structured(method_class(name).config), {"name": name, **options})


def build_method(cfg, model, lr: float, noise: Noise | None, seed: int = 0) -> Method:
    cls = method_class(cfg.name)
    method = cls(model, cfg, lr, noise=noise, seed=seed)
    if cls.privatised_gradient and cfg.subspace.path is not None:
        method.privatize.subspace = SubspaceProjection(cfg.subspace, model, method.privatize.params)
    return method


__all__ = ["build_method", "method_class", "method_config", "Method", "Noise", "METHODS", "Adam", "DPAdam", "MeZO",
           "DPZero", "Grape", "GaLore", "GaLoreDPNaive", "DPSGDRC"]
