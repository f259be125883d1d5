"""What every method shares: the optimiser it wraps and the interface the engine drives."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from dpmem import sharding
from dpmem.config import ConfigError, MethodConfig, accounted, asked_budget, enum_value
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.privacy.calibrate import check as check_privacy
from dpmem.privacy.mechanism import GaussianMechanism

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]  # per-sample losses, shape (B,)


@dataclass(frozen=True)
class MethodSpec:
    """What a method is, as the engine, the checks and the tools read it (`method_class(name).spec`).

    Args:
        private: clips and noises: Poisson-sampled and accounted.
        accountant: what privacy.accountant=auto picks: pld, or rc for randomized clipping.
        privatised_gradient: forms the full-dimensional privatised gradient (subspace re-training, spectrum).
        plan: its clipping plan from its options (`dpmem.methods.clipping_plan`); None: it clips none.
        shardable: without a clipping plan, whether FSDP can run its step (autograd's batch gradient, sharded);
            with one, the plan says.
        compiled_step: train.compile has a compiled step for it (`Method.compile`).
        zeroth_order: forward passes only, no backward (its samples are cheap, its steps many: dpmem plan ranks it
            apart, and plans it without checkpointing).
        no_uls: why its step cannot clip each user's summed gradient (privacy.user_sampling=users, ULS); "": it
            can.
    """
    private: bool = False
    accountant: str = "pld"
    privatised_gradient: bool = False
    plan: Callable[[MethodConfig], ClippingPlan] | None = None
    shardable: bool = False
    compiled_step: bool = False
    zeroth_order: bool = False
    no_uls: str = ""

    def clipping(self, method_cfg) -> ClippingPlan | None:
        """How its per-sample clipping forms the clipped sums under these options; None: it clips none."""
        return self.plan(method_cfg) if self.plan is not None else None

    def shards(self, method_cfg) -> bool:
        """Whether train.fsdp can run its step: its plan's say, or its own; never where subspace re-training
        projects the whole privatised gradient."""
        plan = self.clipping(method_cfg)
        return (plan.shardable if plan is not None else self.shardable) and not (
            self.privatised_gradient and method_cfg.subspace.path is not None)


def make_optimizer(params: Sequence[nn.Parameter], cfg, lr: float) -> torch.optim.Optimizer:
    """torch's for-each implementation on every device (its default on CUDA only): a handful of kernels per step
    instead of several per parameter, and the meta device's plan counts the same code, temporaries included."""
    name = enum_value(cfg.optimizer)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=True)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=True)


def fuse(optimizer: torch.optim.Optimizer) -> None:
    """A compiled step's optimiser: torch's fused implementation (CPU and CUDA), one kernel per step where the
    for-each one (`make_optimizer`, which the memory planner plans) dispatches about ten."""
    for group in optimizer.param_groups:
        group["foreach"], group["fused"] = False, True


def direct_fused_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Can `fused_adam_step` take this optimiser's steps: torch's Adam or AdamW, fused, one group, plain options
    (no amsgrad, maximize, capturable or differentiable), its state made (by an eager first step)?"""
    groups = optimizer.param_groups
    return (isinstance(optimizer, torch.optim.Adam) and len(groups) == 1 and groups[0]["fused"]
            and not any(groups[0][k] for k in ("amsgrad", "maximize", "capturable", "differentiable"))
            and all("exp_avg" in optimizer.state.get(p, {}) for p in groups[0]["params"]))


def fused_adam_step(optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor]) -> None:
    """The update torch's fused Adam/AdamW makes (`torch.optim.adam._fused_adam`: the step counts, then one fused
    kernel), on `grads` in the order of the group's parameters, without torch.optim's per-step Python (the `.grad`
    of each parameter set and cleared, its state and options walked per parameter). The parameters step together,
    so their counts become one tensor, added to once (a for-each add over a count per parameter cost 0.3 ms of a
    5.4 ms host-bound CPU step); `own_step_counts` gives each its own again before a torch step. The state stays
    torch's own: checkpoints are unchanged."""
    group, state = optimizer.param_groups[0], optimizer.state
    params = group["params"]
    count = state[params[0]]["step"]
    if any(state[p]["step"] is not count for p in params):
        if any(not torch.equal(state[p]["step"], count) for p in params):
            raise RuntimeError("the parameters' Adam step counts differ: they cannot share one")
        for p in params:
            state[p]["step"] = count
    beta1, beta2 = group["betas"]
    decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    with torch.no_grad():
        count.add_(1)
        (torch._fused_adamw_ if decoupled else torch._fused_adam_)(
            params, list(grads), [state[p]["exp_avg"] for p in params], [state[p]["exp_avg_sq"] for p in params],
            [], [count] * len(params), amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False, grad_scale=None, found_inf=None)


def own_step_counts(optimizer: torch.optim.Optimizer, args=(), kwargs=None) -> None:
    """A step pre-hook for torch's own step after `fused_adam_step`: it adds 1 to each parameter's count, so each
    gets its own tensor again (a shared one would be added to once per parameter)."""
    for group in optimizer.param_groups:
        counts = [optimizer.state[p]["step"] for p in group["params"] if "step" in optimizer.state.get(p, {})]
        if len(counts) > 1 and counts[0] is counts[-1]:
            for p in group["params"][1:]:
                optimizer.state[p]["step"] = counts[0].clone()


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors a torch optimiser keeps between steps (moments, step counts)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def batch_size(batch: Batch) -> int:
    return len(next(iter(batch.values())))


def check_positive(method_cfg, *keys: str) -> None:
    """Options counted in whole units (probes, rank, steps): each at least 1. Raises ConfigError."""
    for key in keys:
        if method_cfg[key] <= 0:
            raise ConfigError(f"method.{key}", f"{method_cfg[key]} must be a positive integer")


class Method:
    """One logical step from its physical micro-batches. Returns the summed per-sample loss (a tensor, so the
    step never syncs with the host)."""

    config: type = MethodConfig  # its options' schema (dpmem.config); its conf/method/*.yaml names the same one
    spec = MethodSpec()  # what it is (private, accountant, clipping plan, ...), as the engine reads it
    privatizer = None  # first-order private methods: their dpmem.methods.privatize.Privatizer

    @classmethod
    def check(cls, cfg) -> None:
        """What the whole run config must satisfy for this method, beyond each group's own checks
        (dpmem.config.validate_groups): finite options; for a private method, a clipping threshold; and the privacy
        settings that fit it (`dpmem.privacy.calibrate.check`). A method with options of its own extends it. Raises
        ConfigError."""
        t, m = cfg.train, cfg.method
        if t.get("compile") and t.get("static_shapes") is False:
            raise ConfigError("train.static_shapes", "false: a compiled step has one shape, every micro-batch padded "
                              "to the physical batch size; leave it unset (null) or true with train.compile=true")
        for key, value in m.items():  # a NaN or infinite option trains garbage that looks fine: none is allowed
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"method.{key}", f"{value} must be a finite number")
        if cls.spec.private and not m.max_grad_norm > 0:
            # for dpzero C bounds the per-sample scalar (L⁺ − L⁻)/2λ, not a gradient norm
            raise ConfigError("method.max_grad_norm", f"{m.max_grad_norm} must be > 0 for a private method")
        check_privacy(cfg, cls.spec)

    def compile(self, compiler) -> None:
        """train.compile: the step's functions compiled by `compiler` (`dpmem.compiling.Compiler`)."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled step")

    @classmethod
    def warnings(cls, cfg) -> list[str]:
        """What the config allows but is most likely a mistake, each one line (`dpmem train` prints them before it
        runs, and the run goes on)."""
        t, p = cfg.train, cfg.privacy
        said = []
        if cls.spec.private and accounted(p) and t.lr == 0:
            budget = asked_budget(p) if p.epsilon is not None else f"the ε of {asked_budget(p)}"
            said.append(f"train.lr: 0 with {cfg.method.name} spends {budget} and changes nothing "
                        "(the weights never move); set train.lr > 0, or privacy=none")
        if cls.spec.private and accounted(p) and enum_value(p.train_loss) == "private" and p.loss_bound < 1e-3:
            said.append(f"privacy.loss_bound: {p.loss_bound:g} clips every per-sample loss to at most that, so the "
                        "released training loss (and a search scored by it) says next to nothing; losses are "
                        "typically 0.1-10 (default 5)")
        return said

    def __init__(self, model: nn.Module, cfg, lr: float, mechanism: GaussianMechanism | None = None, seed: int = 0):
        """`mechanism` privatises the step (None for a non-private method); its observers see the private step."""
        self.model, self.cfg, self.lr, self.mechanism = model, cfg, lr, mechanism
        self.optimizer: torch.optim.Optimizer | None = None  # methods with their own update leave it None

    def clipping_plan(self, cfg):
        """How its private step clips: the mechanism's plan (a run's, or a broken one), else its configured one (a
        mechanism built by hand has none)."""
        return self.mechanism.plan or self.spec.clipping(cfg)

    @property
    def observers(self) -> tuple:
        """What sees its private step (the mechanism's, `dpmem.methods.privatize.Observer`)."""
        return self.mechanism.observers if self.mechanism is not None else ()

    def close(self) -> None:
        """Remove the hooks the method put on the model."""
        if self.privatizer is not None:
            self.privatizer.close()

    def state_tensors(self) -> list[torch.Tensor]:
        """Tensors the method keeps between steps (optimiser state), for the memory meter."""
        return [] if self.optimizer is None else optimizer_state(self.optimizer)

    def state_dict(self) -> dict:
        """What a checkpoint needs of the method besides the weights: its optimiser's state (the run's keys and
        draws are its mechanism's: `dpmem.engine.checkpoint` saves them apart)."""
        state = {}
        if self.optimizer is not None:  # under FSDP, gathered whole (every rank takes part; rank 0 gets it)
            state["optimizer"] = (sharding.optimizer_state(self.model, self.optimizer)
                                  if sharding.model_sharded(self.model) else self.optimizer.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        if "optimizer" in state:
            if sharding.model_sharded(self.model):
                sharding.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def step(self, microbatches: list[Batch], loss_fn: LossFn) -> torch.Tensor:
        """One logical step on `microbatches` (dicts of tensors; an empty list for an empty Poisson batch, which
        still releases its noise), `loss_fn(model, batch)` giving one loss per sample. Updates the model in place
        and returns the summed per-sample loss."""
        raise NotImplementedError
