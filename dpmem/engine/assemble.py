"""The one way a run is put together, for every tool (docs/design.md, "One way to put a run together"): model →
activation checkpointing → FSDP sharding → mechanism → method, on the data the caller built."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from dpmem import distributed, sharding
from dpmem.config import ConfigError, enum_value
from dpmem.data import DataBundle, users
from dpmem.methods import Method, build_method, method_class
from dpmem.methods.privatize import Observer
from dpmem.methods.rc import check_probes, max_layer_dimension, rc_dimension
from dpmem.methods.subspace import SubspaceProjection
from dpmem.models import build_model, checkpoint_activations
from dpmem.privacy.calibrate import accountant_of, calibrate
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, seed_key


@dataclass
class Parts:
    data: DataBundle
    model: nn.Module
    method: Method
    device: torch.device
    # the run's, calibrated (its accounting, and for a non-private method what it releases); a plan's stand-in
    mechanism: GaussianMechanism | None
    root: sharding.Root | None = None  # under FSDP, what the task's functions are called through
    autocast: Callable = field(default=contextlib.nullcontext)  # a forward pass's context (train.precision)

    @property
    def per_sample_loss(self):
        return self.data.per_sample_loss if self.root is None else self.root.calling(self.data.per_sample_loss)

    def call(self, fn: Callable, *args):
        """`fn(model, *args)`, a task's function of the model (under FSDP through the root, as its forward)."""
        return fn(self.model, *args) if self.root is None else self.root(fn, *args)


def assemble(cfg, device: torch.device, data: DataBundle, model: nn.Module | None = None, *,
             steps: int | None = None, sampling: str | None = None, mesh=None, recompute=None,
             observers: Sequence[Observer] = (), mechanism_of=None) -> Parts:
    """The parts of `cfg` on `device`. `model`: one built already (a plan's, without weights); otherwise the
    model is built with its weights and moved to `device`. `mesh`: shard it over those ranks (train.fsdp).
    `recompute`: the context activation checkpointing's recompute runs in (a plan's attention kernels).
    `observers` see the private step (they hang on the mechanism). `mechanism_of(mechanism, model)`: the mechanism
    to use in place of the calibrated one (dpmem audit's variants).

    With `steps` and `sampling` the mechanism is the run's, calibrated (`dpmem.privacy.calibrate.calibrate`);
    without, a stand-in of σ = 1 (σ and the draws change values, not memory or time), accounting nothing."""
    t, m = cfg.train, cfg.method
    spec = method_class(m.name).spec  # (train.fsdp's caller has checked dpmem.methods.check_fsdp)
    if model is None:
        model = build_model(cfg.model, data).to(device)
    if distributed.world_size() > 1:  # the same initial weights on every rank, but each its own dropout masks
        torch.manual_seed(t.seed + 1_000_003 * distributed.rank())
    if t.activation_checkpointing:
        # a plan (`recompute` given) counts the eager step's recompute, compiled or not
        checkpoint_activations(model, recompute, bool(t.get("compile")) and recompute is None)
    root = sharding.shard_model(model, mesh) if mesh is not None else None
    model.train()
    if observers and not spec.private:
        raise ConfigError("method.name", f"{m.name} is not private: it has no privatised quantity to observe")
    if spec.private and spec.privatised_gradient and m.subspace.path is not None:
        # subspace re-training's projection, the innermost observer: it sees the clipped sums before it projects
        # them, and the release after (the mechanism is a frozen description: it is made with its observers)
        observers = (*observers, SubspaceProjection(m.subspace, model))
    if steps is not None:
        rc = envelope(cfg, model) if accountant_of(cfg.privacy, spec) == "rc" else None
        mechanism = calibrate(cfg, spec, data.n_train, steps, sampling, device, rc, tuple(observers),
                              users.count(data))
    else:
        # no draws where nothing is drawn: on meta, and on the fake tensors of simulated ranks
        draws = None if device.type == "meta" or mesh is not None else Draws(seed_key(0), "noise", device)
        mechanism = (GaussianMechanism(1.0, m.max_grad_norm, float(t.batch_size), draws, observers=tuple(observers),
                                       plan=spec.clipping(m)) if spec.private else None)
    if mechanism_of is not None:
        mechanism = mechanism_of(mechanism, model)
    method = build_method(m, model, t.lr, mechanism if spec.private else None, seed=t.seed)
    return Parts(data, model, method, device, mechanism, root)


def envelope(cfg, model: nn.Module) -> dict:
    """Randomized clipping's envelope, which depends on the model: k probes (method.k, checked against its
    layers), the dimension d (privacy.rc_dimension; inf: the whole model's envelope, `rc_dimension`), the DP-SGD-RC
    paper's max over layers of min(p, d) for comparison, and the estimator."""
    m = cfg.method
    check_probes(model, m.k)  # a run's k (a test may build the method with more, to near exact clipping)
    try:
        d, d_max_layer = rc_dimension(model, cfg.privacy.rc_dimension), max_layer_dimension(model)
    except ValueError as e:
        raise ConfigError("method.name", f"{m.name}: {e}") from None
    return {"k": m.k, "d": d, "d_max_layer": d_max_layer, "estimator": enum_value(m.estimator)}
