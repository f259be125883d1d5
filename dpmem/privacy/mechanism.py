"""The Gaussian mechanism of every private method, and the only code in dpmem that draws DP noise:

    release = ( Σᵢ min(1, C/‖gᵢ‖)·gᵢ + N(0, σ²C² I) ) / (q·n)

`GaussianMechanism` holds σ, C, the expected batch size q·n, the rate q, the secret draws, and the training loss's
release (privacy.train_loss=private: each per-sample loss clipped to [0, L], N(0, (loss_sigma·L)²) on the sum). It
turns per-sample squared norms into clip factors, and a clipped sum into its release: a dict of tensors (eager,
FSDP shards), one flat tensor (the compiled step), or one scalar (DPZero). The Privatizer forms the clipped sums;
the mechanism alone adds noise to them, so a broken mechanism (`dpmem.audit.variants`) is a subclass, not a patch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dpmem import distributed, sharding
from dpmem.persample.clipping import clip_factors
from dpmem.privacy.randomness import Draws, normal

NOISE_BUCKET = 2**24  # elements of noise drawn at once (64 MiB in float32)


@dataclass
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
        sample_rate: q, the rate at which a record joins a step.
        loss_bound: L, each per-sample loss clipped to [0, L]; inf: the loss is summed as it is.
        loss_sigma: the loss's noise multiplier (0: not noised).
    """
    sigma: float
    max_grad_norm: float
    expected_batch_size: float
    draws: Draws | None  # the noise's secret draws (dpmem.privacy.randomness); None: torch's generator (plans)
    sample_rate: float | None = None  # q, the rate at which a record joins a step (dpmem audit's canaries join at it)
    loss_bound: float = math.inf  # L; inf: the loss is summed as it is (not released privately)
    loss_sigma: float = 0.0

    def __post_init__(self):
        # the loss's draws apart from the gradient's: only rank 0 draws them (`released_loss`)
        self.loss_draws = (Draws(self.draws.key, "loss", self.draws.device)
                           if self.draws is not None and self.loss_sigma > 0 else None)
        self.releases = 0  # gradient releases so far (steps), counted by `release`, `release_flat`, `release_scalar`

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
    def release(self, summed: dict, own: Draws | None = None) -> dict:
        """Each clipped sum noised and divided by q·n, in place. A sum every rank holds whole gets the same draw on
        every rank (the draws have one key); a sum sharded by FSDP gets, on each rank, a draw for its own shard from
        `own`, that rank's draws of the step.

        The draw: the sums in order, in runs of at most NOISE_BUCKET elements (a larger sum alone) of one source of
        draws, device, dtype and std; each run gets one standard normal vector of its total size (one keyed draw),
        split into its sums in order. One draw and one for-each add per run, where a draw per sum would cost a
        kernel per parameter. `release_flat` takes the same draws."""
        for run in self._runs(summed, own):
            std = run[0][2]
            if std == 0:  # sigma = 0 only for privacy=none: clipping without noise
                continue
            chunks = _draw(run).split([p.numel() for p, *_ in run])
            torch._foreach_add_([p for p, *_ in run], [c if p.dim() == 1 else c.view(p.shape)
                                                       for (p, *_), c in zip(run, chunks)], alpha=std)
        if summed:
            torch._foreach_div_([sharding.local(s) for s in summed.values()], self.expected_batch_size)
        self.releases += 1
        return summed

    def flat_runs(self, summed: dict) -> list[tuple[int, float]]:
        """The (size, std) of `release`'s runs over `summed` (views of one flat tensor, whole on every rank), in
        order: consecutive slices of the flat tensor, which `release_flat` noises as `release` would the dict."""
        return [(sum(p.numel() for p, *_ in run), run[0][2]) for run in self._runs(summed, None)]

    def release_flat(self, flat: torch.Tensor, runs: list[tuple[int, float]]) -> torch.Tensor:
        """The compiled step's release of its flat clipped sum, in place: each run's draw added to its slice, then
        one division. Eager: on one flat tensor it is an op per run, and a compiled graph's guarded entry would cost
        the host more than it saves."""
        start = 0
        for size, std in runs:
            if std:
                flat[start:start + size].add_(normal(self.draws, (size,), flat.device, flat.dtype), alpha=std)
            start += size
        self.releases += 1
        return flat.div_(self.expected_batch_size)

    def release_scalar(self, total: torch.Tensor) -> torch.Tensor:
        """DPZero's release of its clipped sum of scalars (the same on every rank: one key)."""
        std = self.noise_std(None)
        if std:
            total = total + std * normal(self.draws, (), total.device, total.dtype)
        self.releases += 1
        return total / self.expected_batch_size

    def released_loss(self, clipped_sum: torch.Tensor) -> torch.Tensor:
        """This rank's clipped loss sum as released: with N(0, (loss_sigma·L)²) on rank 0 alone, since the trainer
        sums the ranks' sums (one draw in all)."""
        if self.loss_sigma == 0 or not distributed.is_main():
            return clipped_sum
        z = normal(self.loss_draws, (), clipped_sum.device, clipped_sum.dtype)
        return clipped_sum + self.loss_sigma * self.loss_bound * z

    def _runs(self, summed: dict, own: Draws | None):
        """Consecutive (part, draws, std) of one source of draws, device, dtype and std, at most NOISE_BUCKET
        elements together (a larger part alone): a part is a sum, or this rank's shard of it (drawn from `own`)."""
        run, size = [], 0
        for key, s in summed.items():
            part = sharding.local(s)
            item = (part, own if part is not s and own is not None else self.draws, self.noise_std(key))
            if run and (size + part.numel() > NOISE_BUCKET or item[1:] != run[0][1:]
                        or (part.device, part.dtype) != (run[0][0].device, run[0][0].dtype)):
                yield run
                run, size = [], 0
            run.append(item)
            size += part.numel()
        if run:
            yield run


def _draw(run: list) -> torch.Tensor:
    first, draws, _ = run[0]
    return normal(draws, (sum(p.numel() for p, *_ in run),), first.device, first.dtype)
