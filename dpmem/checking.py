"""`dpmem.api.check(model, loss_fn, batch)`: what Opacus' ModuleValidator says, but exact, on the CPU before a GPU is
rented. Which rule owns each trainable parameter (or the one-line refusal of a layer no rule covers), the
attribution proof on a sample batch under every clipping plan (a RuntimeError naming what mixes samples), and each
plan's measured step memory (the live-tensor counter: exact bytes on the CPU)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from dpmem.metering import LiveTensorCounter
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.privatize import Privatizer
from dpmem.persample.fallback import replay_of
from dpmem.persample.owners import find_owners
from dpmem.privacy.mechanism import GaussianMechanism

PLANS = ("materialize", "bk", "ghost", "mixed", "fgc")
MiB = 2 ** 20


@dataclass
class Check:
    """What `check` found: `rules` (module, how its per-sample gradients are formed, its trainable parameters' count),
    and per plan the peak bytes of a step after the proof and their per-sample part."""
    rules: list[tuple[str, str, int]]
    plans: dict[str, dict[str, int]] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = ["| module | per-sample rule | parameters |", "|---|---|---:|"]
        lines += [f"| {name or '(model)'} | {how} | {count:,} |" for name, how, count in self.rules]
        lines += ["", "The attribution proof passed under every plan below.", "",
                  "| plan | step peak (MiB) | per-sample part (MiB) |", "|---|---:|---:|"]
        lines += [f"| {plan} | {m['peak'] / MiB:.2f} | {m['per_sample'] / MiB:.2f} |" for plan, m in self.plans.items()]
        return "\n".join(lines)


def _how(owner) -> str:
    if owner.rule is not None:
        kind = "factored" if owner.rule.factored(owner.module) else "dense"
        return f"{type(owner.module).__name__} rule ({kind})"
    replay = replay_of(owner.module)
    how = "one sample at a time" if replay is not None and replay.loop else "per sample under vmap"
    return f"{type(owner.module).__name__} replayed {how} (dense)"


def check(model: nn.Module, loss_fn, batch: dict, plans=PLANS) -> Check:
    """Check `model` with its per-sample `loss_fn(model, batch)` on `batch` (a dict of tensors: a few samples do).
    Raises ValueError for a layer no rule covers (naming it and the fix) and RuntimeError where the attribution
    proof fails (naming what mixes samples). Nothing is released (σ 0, no draws); the model's weights and `.grad`
    are left as they were."""
    rules = [(o.name, _how(o), sum(p.numel() for p in o.params.values())) for o in find_owners(model)]
    out = Check(rules)
    for plan in plans:
        with Privatizer(model, GaussianMechanism(0.0, 1.0, 1.0, None), ClippingPlan.of(plan)) as privatizer:
            shapes = {p: p.shape for p in privatizer.params}
            privatizer.gradient([batch], loss_fn, shapes)  # the proof, on its first micro-batch
            with LiveTensorCounter() as counter:  # a step as every later one runs
                privatizer.gradient([batch], loss_fn, shapes)
        out.plans[plan] = {"peak": counter.peak, "per_sample": counter.peak_breakdown["per_sample"]}
    return out
