"""Training methods, one file each. `build_method` maps the config's method name to its class."""

from __future__ import annotations

from dpmem.config import ConfigError
from dpmem.methods.adam import Adam
from dpmem.methods.base import Method, Noise
from dpmem.methods.dp_adam import DPAdam

METHODS = {"adam": Adam, "dp-adam": DPAdam, "dp-sgd": DPAdam}


def build_method(cfg, model, lr: float, noise: Noise | None) -> Method:
    if cfg.name not in METHODS:
        raise ConfigError("method.name", f"{cfg.name!r} is unknown; allowed: {', '.join(METHODS)}")
    cls = METHODS[cfg.name]
    if cls.private != bool(cfg.private):
        raise ConfigError("method.private", f"{cfg.name} is {'private' if cls.private else 'non-private'}")
    return cls(model, cfg, lr, noise) if cls.private else cls(model, cfg, lr)


__all__ = ["build_method", "Method", "Noise", "METHODS"]
