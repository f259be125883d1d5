"""Training methods, one file each. `build_method` maps the config's method name to its class."""

from __future__ import annotations

import dataclasses
import numbers

from omegaconf import OmegaConf

from dpmem.config import ConfigError, validate_groups
from dpmem.methods.adam import Adam
from dpmem.methods.base import Method
from dpmem.methods.dp_adam import DPAdam
from dpmem.methods.dpzero import DPZero, MeZO
from dpmem.methods.galore import GaLore, GaLoreDPNaive
from dpmem.methods.grape import Grape
from dpmem.methods.rc import DPSGDRC
from dpmem.methods.subspace import SubspaceProjection
from dpmem.privacy.mechanism import GaussianMechanism

METHODS = {"adam": Adam, "dp-adam": DPAdam, "dp-sgd": DPAdam, "mezo": MeZO, "dpzero": DPZero,
           "grape": Grape, "galore": GaLore, "galore-dp-naive": GaLoreDPNaive, "dp-sgd-rc": DPSGDRC}


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise ConfigError("method.name", f"{name!r} is unknown; allowed: {', '.join(METHODS)}")
    return METHODS[name]


def validate(cfg) -> None:
    """Every check of a run config that its types cannot express: each group's (dpmem.config.validate_groups),
    train.compile's, then what the method's class requires of the whole config (Method.check). Raises ConfigError."""
    cls = method_class(cfg.method.name)  # an unknown method is reported first
    validate_groups(cfg)
    if cfg.train.get("compile") and not cls.spec.compiled_step:
        compiled = ", ".join(n for n, c in METHODS.items() if c.spec.compiled_step)
        raise ConfigError("train.compile", f"{cfg.method.name} has no compiled step; allowed: {compiled} (or "
                          "train.compile=false)")
    if cfg.train.get("compile") and cfg.train.fsdp:
        raise ConfigError("train.compile", "dynamo stops at FSDP2's forward hooks, which torch keeps out of graphs "
                          "(torch._dynamo.disable); with train.fsdp: train.compile=false")
    cls.check(cfg)


def check_fsdp(method_cfg) -> None:
    """Refuse train.fsdp when the step needs whole parameters or gradients (see dpmem.sharding). Raises
    ConfigError."""
    spec = method_class(method_cfg.name).spec
    if spec.shards(method_cfg):
        return
    plan = spec.clipping(method_cfg)
    shard = [n for n, c in METHODS.items() if c.spec.shards(method_config(n))]  # at their defaults
    two_pass = [n for n, c in METHODS.items() if n not in shard and c.spec.plan is not None
                and c.spec.shards(method_config(n, clipping="ghost"))]
    raise ConfigError("train.fsdp", f"method={method_cfg.name} ({plan.name if plan else 'its step'}) needs whole "
                      f"parameters or gradients; with FSDP: {', '.join(shard)} (at their defaults), and "
                      f"{', '.join(two_pass)} with two-pass clipping (method.clipping=fgc, ghost or mixed)")


def method_config(name: str, **options):
    """The config of method `name` with its schema's defaults, e.g. method_config("grape", rank=4) in Python."""
    return OmegaConf.merge(OmegaConf.structured(method_class(name).config), {"name": name, **options})


def build_method(cfg, model, lr: float, mechanism: GaussianMechanism | None, seed: int = 0) -> Method:
    """The method of `cfg`, privatised by `mechanism` (None for a non-private method). Subspace re-training's
    projection (method.subspace.path) joins the mechanism's observers as the innermost one: they see the clipped
    sums before it projects them, and the release after."""
    cls = method_class(cfg.name)
    if not isinstance(lr, numbers.Real) or isinstance(lr, bool):  # else torch's optimiser fails comparing it
        raise TypeError(f"{cfg.name}: lr={lr!r} ({type(lr).__name__}): allowed a number")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{cfg.name}: the model has no trainable parameter (every one has requires_grad=False): "
                         "nothing to train")
    if (cls.spec.privatised_gradient and cfg.subspace.path is not None
            and not any(isinstance(o, SubspaceProjection) for o in mechanism.observers)):
        # the mechanism is a frozen description: one with the projection too, before anything is drawn
        mechanism = dataclasses.replace(mechanism, observers=(*mechanism.observers,
                                                              SubspaceProjection(cfg.subspace, model)))
    return cls(model, cfg, lr, mechanism=mechanism, seed=seed)


__all__ = ["build_method", "check_fsdp", "method_class", "method_config", "validate", "Method",
           "METHODS", "Adam", "DPAdam", "MeZO", "DPZero", "Grape", "GaLore", "GaLoreDPNaive", "DPSGDRC"]
