"""Training methods, one file each. `build_method` maps the config's method name to its class."""

from __future__ import annotations

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


def build_method(cfg, model, lr: float, noise: Noise | None, seed: int = 0) -> Method:
    if cfg.name not in METHODS:
        raise ConfigError("method.name", f"{cfg.name!r} is unknown; allowed: {', '.join(METHODS)}")
    cls = METHODS[cfg.name]
    if cls.private != bool(cfg.private):
        raise ConfigError("method.private", f"{cfg.name} is {'private' if cls.private else 'non-private'}")
    method = cls(model, cfg, lr, noise=noise, seed=seed)
    if cfg.subspace.path is not None:
        if cls is Grape or not hasattr(method, "privatize"):  # grape's clipped sums live in its projected space
            raise ConfigError("method.subspace.path", f"{cfg.name} has no full privatised gradient to project; "
                              "allowed with dp-adam, dp-sgd, galore-dp-naive, dp-sgd-rc")
        method.privatize.subspace = SubspaceProjection(cfg.subspace, model, method.privatize.params)
    return method


__all__ = ["build_method", "Method", "Noise", "METHODS", "Adam", "DPAdam", "MeZO", "DPZero", "Grape", "GaLore",
           "GaLoreDPNaive", "DPSGDRC"]
