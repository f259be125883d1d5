"""What a micro-batch clips as one unit: each record, or under user-level sampling (ULS, privacy.unit=user) a user
of k slots (`Grouped`), whose records' gradients are summed before the norm. The Privatizer asks the unit once per
micro-batch (`ClippedUnit.of`) for how the per-sample reductions, weights and losses go, instead of asking whether
the micro-batch is grouped at each of them."""

from __future__ import annotations

from typing import NamedTuple

import torch

from dpmem.data.bundle import Grouped, weights
from dpmem.methods.base import batch_size
from dpmem.persample import reducers


class ClippedUnit(NamedTuple):
    """`grouped`: the micro-batch is a `Grouped` one (slots of users, some empty). `k`: a user's slots, summed
    before the norm; None: each record is clipped alone (a micro-batch of records, or a broken run that clips a
    `Grouped` one record by record while claiming a user's ε: the mechanism's per_user False,
    `dpmem.audit.variants`)."""
    grouped: bool = False
    k: int | None = None

    @classmethod
    def of(cls, mb: dict, per_user: bool = True) -> ClippedUnit:
        grouped = isinstance(mb, Grouped)
        return cls(grouped, mb.k if grouped and per_user else None)

    def count(self, mb: dict) -> int:
        """The micro-batch's clipped units: its users, or its records."""
        return len(mb.weights) if self.k else batch_size(mb)

    def reducers(self, reduce: dict) -> dict:
        """Each parameter's per-sample reduction, a user's k records summed first (`reducers.by_user`)."""
        return reduce if self.k is None else {p: reducers.by_user(r, self.k) for p, r in reduce.items()}

    def loss_fn(self, loss_fn):
        """The per-record losses, an empty slot's weighing 0 (`Grouped.present`), so that its gradient, which joins
        its user's sum, is 0."""
        return (lambda model, mb: loss_fn(model, mb) * mb.present) if self.grouped else loss_fn

    def per_record(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """A value per unit as one per record: a user's for each of its k slots."""
        return values.repeat_interleave(self.k) if self.k and values is not None else values

    def weights(self, mb: dict) -> torch.Tensor | float:
        """How much each unit counts in the step (its clip factor, its loss): a slot's presence where a `Grouped`
        micro-batch's records are clipped one by one, else the micro-batch's weights (`bundle.weights`)."""
        return mb.present if self.grouped and not self.k else weights(mb)

    def loss(self, clipped: torch.Tensor, mb: dict) -> torch.Tensor:
        """The micro-batch's sum of clipped losses (`clipped`, one per record), a user's the mean of its records'
        (in [0, L] as a record's is)."""
        if self.k:
            clipped = clipped.view(-1, self.k).sum(1) / mb.present.view(-1, self.k).sum(1).clamp(min=1)
        return (clipped * self.weights(mb)).sum()
