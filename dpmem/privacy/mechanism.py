"""The Gaussian mechanism of every private method, and the only code in dpmem that draws DP noise:

    release = ( Σᵢ min(1, C/‖gᵢ‖)·gᵢ + N(0, σ²C² I) ) / (q·n)

`GaussianMechanism` holds σ, C, the expected batch size q·n, the rate q, the secret draws, and the training loss's
release. It turns per-sample squared norms into clip factors, and a clipped sum into its release: a dict of tensors
(eager, FSDP shards), one flat tensor (the compiled step), or one scalar (DPZero). The Privatizer forms the clipped
sums; the mechanism alone adds noise to them, so a broken mechanism (`dpmem.audit.variants`) is a subclass, not a
patch.

A run's mechanism (`calibrate`) holds its privacy as one value (`record.Record`, from its config by `record_of`),
which the run's summary and its append-only ledger (privacy.jsonl) write; `record.line_epsilon` reads a ledger
line's event back. An infinite ε (no privacy: a non-private method, privacy=none, a leaking subspace) is math.inf
here and "inf" in summary.json and metrics.jsonl (JSON has no infinity; `float("inf")` reads it back).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import InitVar, dataclass, field

import torch

from dpmem import distributed, sharding
from dpmem.persample.clipping import clip_factors
from dpmem.privacy.randomness import Draws, normal
from dpmem.privacy.record import Record
from dpmem.privacy.state import MechanismState
from dpmem.privacy.strategies import Strategy

NOISE_BUCKET = 2**24  # elements of noise drawn at once (64 MiB in float32)


@dataclass(frozen=True)
class GaussianMechanism:
    """The Gaussian mechanism of a private step: std σ·C on the clipped sum, divided by the expected batch size q·n
    (fixed, so that the normalisation itself reveals nothing about the sampled batch); and, where the training loss
    is released privately (privacy.train_loss=private), std loss_sigma·L on the batch's sum of per-sample losses
    clipped to [0, L] (dpmem.privacy.accounting composes the two).

    Args:
        sigma: the noise multiplier σ (`calibrate_sigma`'s).
        max_grad_norm: the clipping norm C.
        expected_batch_size: q·n, what the noised sum is divided by.
        draws: the noise's secret draws, `Draws(key_of(None), "noise")`; None draws from torch's generator, for
            plans only.
        sample_rate: q, the rate at which a record joins a step (dpmem audit's canaries join at it).
        loss_bound: L, each per-sample loss clipped to [0, L]; inf: the loss is summed as it is.
        loss_sigma: the loss's noise multiplier (0: not noised).
        observers: what sees the private step, in order (`dpmem.methods.privatize.Observer`: dpmem audit's
            canaries, dpmem spectrum's recorder, a subspace's projection).
        plan: how the clipped sums are formed (`dpmem.methods.clipping_plan.ClippingPlan`), a run's (`calibrate`)
            or a broken one (`dpmem.audit.variants`); None: the method's configured plan (DPZero clips a scalar).
        strategy: how a release's noise is correlated with earlier ones (`dpmem.privacy.strategies`); None or
            independent: fresh noise each release.
        restart: a projected method's refresh F, where correlated noise restarts (`dpmem.privacy.correlated`).
        per_user: ULS (privacy.unit=user): a user's records (a `Grouped` micro-batch's) are clipped as one; False
            clips each record, which only a broken run does while claiming a user's ε (`dpmem.audit.variants`).

    A run's mechanism (`calibrate`) also holds its accounting; one built by hand accounts nothing (`accounted`).
    It is a frozen description: what changes as it releases is its `state` (`MechanismState`), which it alone
    saves and restores (`state_dict`, `load_state_dict`), and the keys and counts inside its `Draws`.
    """
    sigma: float
    max_grad_norm: float
    expected_batch_size: float
    draws: InitVar[Draws | None] = None
    sample_rate: float | None = None
    loss_bound: float = math.inf
    loss_sigma: float = 0.0
    observers: tuple = ()
    plan: object = None
    # -- a run's accounting (`calibrate`) ------------------------------------------------------------------------
    record: Record | None = None  # the run's privacy (`calibrate`); None: one built by hand, which accounts nothing
    summary: dict = field(default_factory=dict)  # the run summary's privacy fields
    strategy: Strategy | None = None
    restart: int | None = None
    per_user: bool = True
    # every key and count it draws with, and what it changes as it releases: made from `draws` (and a run's sampler,
    # `calibrate`), or a derived mechanism's base's (`dataclasses.replace` passes it on)
    state: MechanismState | None = field(default=None, compare=False, repr=False)

    def __post_init__(self, draws: Draws | None):
        # refused here, where a bad value would otherwise flip the noise's sign, zero every gradient or divide by 0
        for name, ok, allowed in (("sigma", lambda v: 0 <= v < math.inf, ">= 0 (0: no noise)"),
                                  ("max_grad_norm", lambda v: v > 0, "> 0 (inf: no clipping)"),
                                  ("expected_batch_size", lambda v: 0 < v < math.inf, "> 0")):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not ok(value):  # NaN fails `ok`
                raise ValueError(f"GaussianMechanism: {name}={value!r}: allowed a number {allowed}")
        if self.state is None:
            object.__setattr__(self, "state", MechanismState(draws))
        elif draws is not None:
            raise ValueError("GaussianMechanism: draws= and state= both given: the state holds the draws")
        self.state.made_for(self.loss_sigma > 0, self.strategy, self.restart)

    # the state's, read where the description is read
    sampler = property(lambda self: self.state.sampler)
    releases = property(lambda self: self.state.releases)
    loss_draws = property(lambda self: self.state.loss)
    correlated = property(lambda self: self.state.correlated)
    leak = property(lambda self: self.state.leak)
    reseeded = property(lambda self: self.state.reseeded)

    # -- accounting -----------------------------------------------------------------------------------------------
    @property
    def accounted(self) -> bool:
        return self.delta is not None

    # the record's, read where the mechanism is read: a non-private method's run, which is given no mechanism (ε ∞,
    # nothing released); the event ε is computed from (none, or δ None: nothing accounted: privacy=none, a plan);
    # the training loss's release (private, in ε; exact, outside it; none)
    private = property(lambda self: True if self.record is None else self.record.private)
    event = property(lambda self: None if self.record is None else self.record.event)
    loss_release = property(lambda self: "exact" if self.record is None else self.record.loss_release)
    delta = property(lambda self: None if self.event is None else self.event.delta)
    # cyclic sampling's G, the sampler's groups (`dpmem.privacy.sampling`); None: not cyclic, or built by hand
    groups = property(lambda self: None if self.event is None else self.event.groups)

    def epsilon(self, steps: int) -> float:
        """ε spent after `steps` steps, and no less than an earlier attempt of the run released: math.inf when
        nothing is accounted or the run leaks; NaN on torchrun's ranks other than 0, which write no summary."""
        if not self.accounted or self.leak is not None:
            return math.inf
        if not distributed.is_main():
            return math.nan
        return max(self.event.epsilon(steps), self.state.released)

    def spent_before(self, epsilon: float) -> None:
        """What an earlier attempt of this run released (a resume reads it from the ledger): ε never goes below."""
        self.state.released = max(self.state.released, epsilon)

    def mark_leak(self, why: str) -> None:
        """ε is void: the run releases what its own data chose (a subspace computed from the training set)."""
        self.state.leak = why
        self.summary.update(private=False, epsilon_spent=math.inf)

    def ledger_fields(self) -> dict:
        """What a privacy.jsonl line records beside its ε and steps: what ε is computed from (`Event.line`), and
        the record's unit and analysis as the summary names them (`Record.summary`)."""
        said = self.record.summary()
        return {"sigma": said["sigma"], **self.event.line(), "unit": said["unit"], "users": said.get("users"),
                "privacy_analysis": said["privacy_analysis"]}

    def outside_epsilon(self, static_shapes: bool) -> dict[str, str]:
        """What an accounted run's folder (and wandb, and its progress bar) shows that ε does not cover, and why (what
        it does cover: docs/privacy.md, "What a private run releases")."""
        out = {"metric_final, metric_best, metrics": "evaluated on the held-out split, which epsilon does not "
                                                     "protect (it protects the training set)",
               "wall_time_s, throughput_samples_per_s, samples_per_s": "timings, which depend on the sampled "
                                                                       "batches' sizes (a side channel)"}
        if not static_shapes:
            out["peak_memory_bytes, peak_memory_allocated_bytes, memory_bytes"] = (
                "peaks, which depend on the largest sampled micro-batch (train.static_shapes=true pads every "
                "micro-batch to one size: then they do not)")
        if self.loss_release == "exact":
            out["train_loss_outside_epsilon, loss_outside_epsilon"] = ("the exact training loss "
                                                                       "(privacy.train_loss=exact)")
        return out

    def noise_std(self, key) -> float:
        """The std of the noise on the clipped sum of `key` (a parameter; None for DPZero's scalar): σC. A broken
        mechanism overrides it (`dpmem.audit.variants`)."""
        return self.sigma * self.max_grad_norm

    # -- clipping -------------------------------------------------------------------------------------------------
    def clip_factors(self, squares: dict) -> torch.Tensor:
        """min(1, C/‖gᵢ‖) from per-sample squared norms (B,) by group of parameters (`{key: squares}`,
        `dpmem.persample.clipping.grouped_squares`)."""
        return clip_factors(torch.stack(list(squares.values())).sum(0).sqrt_(), self.max_grad_norm)

    def clipped_losses(self, losses: torch.Tensor) -> torch.Tensor:
        """Per-sample losses as the loss sum takes them: clipped to [0, L] when the loss is released privately."""
        return losses if math.isinf(self.loss_bound) else losses.clamp(0, self.loss_bound)

    # -- releases -------------------------------------------------------------------------------------------------
    def release(self, summed: dict, own: Draws | None = None, flat: torch.Tensor | None = None) -> dict:
        """Each clipped sum noised and divided by q·n, in place: the one release of every path (eager, FSDP, the
        compiled step, DPZero's scalar under key None). A sum every rank holds whole gets the same draw on every
        rank (the draws have one key); a sum sharded by FSDP gets, on each rank, a draw for its own shard from
        `own`, that rank's draws of the step.

        Each of the sums' runs (`_runs`) gets one standard normal vector of its total size (one keyed draw, or the
        correlated strategy's), split into its sums in order: one draw and one for-each add per run, where a draw
        per sum would cost a kernel per parameter. `flat`: the compiled step's flat clipped sum, of which `summed`
        holds views, in order: each run's noise is added to its slice of it and one division follows (an op per
        run; a compiled graph's guarded entry would cost the host more than it saves)."""
        if flat is not None:
            return self._release_flat(summed, flat)
        for index, run in enumerate(self._runs(summed, own)):
            first, draws, std = run[0]
            if std == 0:  # sigma = 0 only for privacy=none: clipping without noise
                continue
            sizes = [p.numel() for p, *_ in run]
            shard = f"/{distributed.rank()}" if draws is own and own is not None else ""
            chunks = self._noise(f"{index}{shard}", draws, (sum(sizes),), first.device, first.dtype).split(sizes)
            torch._foreach_add_([p for p, *_ in run], [c if p.dim() == 1 else c.view(p.shape)
                                                       for (p, *_), c in zip(run, chunks)], alpha=std)
        if summed:
            torch._foreach_div_([sharding.local(s) for s in summed.values()], self.expected_batch_size)
        self._released()
        return summed

    def _release_flat(self, summed: dict, flat: torch.Tensor) -> dict:
        """`release` on the compiled step's flat sum: its runs, (size, std), are the first compiled step's (a broken
        mechanism whose std varies by release is never compiled: the audit's observers refuse it)."""
        if self.state.flat_runs is None:
            self.state.flat_runs = [(sum(p.numel() for p, *_ in run), run[0][2]) for run in self._runs(summed, None)]
        start = 0
        for index, (size, std) in enumerate(self.state.flat_runs):
            if std:
                noise = self._noise(str(index), self.state.noise, (size,), flat.device, flat.dtype)
                flat[start:start + size].add_(noise, alpha=std)
            start += size
        flat.div_(self.expected_batch_size)
        self._released()
        return summed

    def released_loss(self, clipped_sum: torch.Tensor) -> torch.Tensor:
        """This rank's clipped loss sum as released: with N(0, (loss_sigma·L)²) on rank 0 alone, since the trainer
        sums the ranks' sums (one draw in all)."""
        if self.loss_sigma == 0 or not distributed.is_main():
            return clipped_sum
        z = normal(self.loss_draws, (), clipped_sum.device, clipped_sum.dtype)
        return clipped_sum + self.loss_sigma * self.loss_bound * z

    def _noise(self, run: str, draws: Draws | None, shape: tuple, device, dtype) -> torch.Tensor:
        """Run `run`'s standard normal noise of this release: fresh from `draws`, or the correlated strategy's."""
        if self.correlated is None:
            return normal(draws, shape, device, dtype)
        return self.correlated.noise(run, shape, device, dtype)

    def _released(self) -> None:
        self.state.releases += 1
        if self.correlated is not None:
            self.correlated.advance()

    # -- state ----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint keeps of the run's privacy (`MechanismState.state_dict`)."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """The saved state (`MechanismState.load_state_dict`; `reseeded` says why the noise was keyed afresh)."""
        self.state.load_state_dict(state)

    def _runs(self, summed: dict, own: Draws | None):
        """Consecutive (part, draws, std) of one source of draws, device, dtype and std, at most NOISE_BUCKET
        elements together (a larger part alone): a part is a sum, or this rank's shard of it (drawn from `own`)."""
        run, size = [], 0
        for key, s in summed.items():
            part = sharding.local(s)
            item = (part, own if part is not s and own is not None else self.state.noise, self.noise_std(key))
            if run and (size + part.numel() > NOISE_BUCKET or item[1:] != run[0][1:]
                        or (part.device, part.dtype) != (run[0][0].device, run[0][0].dtype)):
                yield run
                run, size = [], 0
            run.append(item)
            size += part.numel()
        if run:
            yield run
