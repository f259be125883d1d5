"""How a private method forms Σᵢ min(1, C/‖gᵢ‖)·gᵢ: one value, built once by the method from its config
(`Method.clipping`), read by the Privatizer, FSDP's check, the trainer's checkpointing warning and the summary.

- materialize: one backward pass keeps every parameter's dense per-sample gradients, then norms and the weighted sum;
- bk (book-keeping, Bu et al. ICML 2023): one backward pass keeps each linear-like layer's factors (its input A and
  output gradient G; dense per-sample gradients of the rest), exact norms from them (T×T Gram matrices or the
  layer's per-sample products, whichever is smaller), then the clipped sum (c ⊙ G)ᵀA per layer;
- fgc | ghost | mixed | hutch | hutchpp: two passes (Opacus' fast gradient clipping). The first backward keeps only
  per-sample squared norms, made as it leaves each layer (`dpmem.persample.norms` says how each rule gets them), and
  goes no further than the layers' output gradients (no weight's batch product: `dpmem.persample.taps`); the second
  back-propagates Σᵢ min(1, C/‖gᵢ‖)·Lᵢ through the same graph, so autograd itself sums the clipped gradients.
  With an estimator (DP-SGD-RC) ‖gᵢ‖ is the square root of the summed estimates; with book-keeping it takes them in
  bk's one pass instead (the same clip factors, the clipped sums from the kept factors).
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
        if name == "materialize":  # dense per-sample gradients: ghost norms them exactly (a sparse embedding's too)
            return cls(name, "ghost", "gradients", k, projected)
        if name == "bk":
            return cls(name, "mixed", "factors", k, projected)
        if bookkeeping:
            return cls(name, name, "factors", k, projected)
        return cls(name, name, "norms", k, projected)

    @property
    def passes(self) -> int:
        """Backward passes per micro-batch: 1 keeps per-sample gradients (or factors) until the norms are known; 2
        keeps norms only, and the second pass forms the clipped sums."""
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
