"""How a private method forms Σᵢ min(1, C/‖gᵢ‖)·gᵢ (docs/methods.md, Clipping modes): one value, built once from the
method's config (`MethodSpec.clipping`), read by the Privatizer, FSDP's check, the trainer's checkpointing warning
and the summary. One pass keeps dense per-sample gradients (materialize) or each linear-like layer's factors (bk,
book-keeping, Bu et al. ICML 2023) until the norms are known; two (fgc, ghost, mixed, hutch, hutchpp: Opacus' fast
gradient clipping) keep squared norms only, then back-propagate Σᵢ min(1, C/‖gᵢ‖)·Lᵢ, so that autograd itself sums
the clipped gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpmem.config import enum_value
from dpmem.persample.norms import ESTIMATORS, RULES

CHOICES = ("materialize", "bk") + RULES
KEEPS = ("gradients", "factors", "norms")


@dataclass(frozen=True)
class ClippingPlan:
    """How a private step clips: which norm rule, what the backward keeps until the norms are known, and so how many
    backward passes a micro-batch takes. Made from a method's `clipping` option by `ClippingPlan.of`."""
    name: str  # what the method's config chose (materialize, bk, fgc, ghost, mixed, hutch, hutchpp): the summary's
    norms: str  # the dpmem.persample.norms rule that norms what the backward keeps
    keeps: str  # gradients (dense), factors (book-keeping: each layer's input and output gradient) or norms only
    k: int = 32  # probes of an estimator
    projected: bool = False  # DP-GRAPE: the kept per-sample gradients are small projections

    def __post_init__(self):
        if self.name not in CHOICES:
            raise ValueError(f"clipping {self.name!r}: allowed {', '.join(CHOICES)}")
        if self.keeps not in KEEPS:
            raise ValueError(f"clipping {self.name!r} cannot keep {self.keeps!r}: allowed {', '.join(KEEPS)}")
        if self.projected and self.passes != 1:
            raise ValueError(f"projected per-sample gradients need one-pass clipping, not {self.name!r}")

    @classmethod
    def of(cls, name: str, k: int = 32, bookkeeping: bool = False, projected: bool = False) -> "ClippingPlan":
        """The plan of a configured choice.

        Args:
            name: `materialize`, `bk`, `fgc`, `ghost`, `mixed` (exact norms) or `hutch`, `hutchpp` (estimated).
            k: probes of an estimator.
            bookkeeping: take an estimator's norms in bk's one pass.
            projected: DP-GRAPE's projected per-sample gradients (one-pass plans only).

        Returns:
            The plan, for `Privatizer(..., plan=...)`.
        """
        if bookkeeping and name not in ESTIMATORS:
            raise ValueError(f"bookkeeping with an estimator ({', '.join(ESTIMATORS)}), not {name!r}; "
                             "exact norms have clipping='bk'")
        # materialize's dense per-sample gradients: ghost norms them exactly (a sparse embedding's too)
        norms, keeps = {"materialize": ("ghost", "gradients"), "bk": ("mixed", "factors")}.get(
            name, (name, "factors" if bookkeeping else "norms"))
        return cls(name, norms, keeps, k, projected)

    @property
    def passes(self) -> int:
        """Backward passes per micro-batch (the module docstring says what each keeps)."""
        return 2 if self.keeps == "norms" else 1

    @property
    def bookkeeping(self) -> bool:
        """Each layer's input and output gradient stay until the norms are known: activation checkpointing cannot
        drop them, FSDP cannot shard them."""
        return self.keeps == "factors"

    @property
    def shardable(self) -> bool:
        """FSDP can run it: autograd forms the clipped sums (two passes), or they are small projections."""
        return self.passes == 2 or self.projected

    @property
    def estimated(self) -> bool:
        return self.norms in ESTIMATORS


def configured(method_cfg) -> ClippingPlan:
    """The plan a method's `clipping` option names (dp-adam, dp-sgd, galore-dp-naive)."""
    return ClippingPlan.of(enum_value(method_cfg.clipping))
