"""What a capture keeps of one parameter's per-sample gradient. A reducer is applied once the parameter's last use
in the forward pass has had its output gradient, so a weight used several times (a tied LM head) is reduced as the
sum over its uses: normed and clipped as one, never per use. It takes the per-sample gradient, `Factored`
(linear-like weights, embedding ids) or dense (B, *shape), and returns what the caller keeps; the rest is freed
then, one layer at a time.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from dpmem.persample.clipping import is_rows
from dpmem.persample.factored import Factored, weighted_sum_of
from dpmem.persample.norms import squared_norms
from dpmem.persample.projection import Projection
from dpmem.privacy.randomness import Draws

Reducer = Callable[[Any], Any]


class Normed(NamedTuple):
    """What one-pass clipping keeps of a parameter: its squared per-sample norms (B,) (None for rows), and its
    per-sample gradients (`Factored` or dense) for the clipped sum once every norm is known."""
    squares: torch.Tensor | None
    grads: Any


class Summed(NamedTuple):
    """What a reducer keeps of a parameter, and Σᵢ gᵢ: the coverage check's sum (for autograd's batch gradient)."""
    value: Any
    total: torch.Tensor


def materialize(g):
    """Dense per-sample gradients (B, *shape); an embedding's stay factored (dense they would be B×vocab×D)."""
    return g.to_dense() if isinstance(g, Factored) and not g.sparse else g


def projection(made: Projection | Callable[[], Projection]) -> Projection:
    """A projection given, or made now by what makes it."""
    return made if isinstance(made, Projection) else made()


def projected(made: Projection | Callable[[], Projection], then: Reducer = materialize) -> Reducer:
    """DP-GRAPE: P applied to the factors, then `then` (by default the small (B, r, cols) or (B, rows, r) product).
    Given as what makes it, the projection is made when the layer's gradient is reduced and dropped after it; a
    compiled step is given the projection itself."""
    return lambda g: then(g.project(projection(made)))


def norms(rule: str, k: int = 32, draws: Draws | None = None) -> Reducer:
    """Squared per-sample norms (B,) by a rule of `dpmem.persample.norms` (two-pass clipping's first pass)."""
    return lambda g: squared_norms(g, rule, k, draws)


def normed(rule: str = "mixed", k: int = 32, draws: Draws | None = None,
           then: Reducer = lambda g: g) -> Reducer:
    """`Normed`: squared norms and what `then` keeps; one-pass clipping. By default the factors as they are
    (book-keeping), normed now (exactly, ghost or the per-sample product, whichever is smaller; or a DP-SGD-RC
    estimate) and kept for the clipped sum (c ⊙ G)ᵀA once every norm is known; with `then=materialize`, dense
    gradients. A vector parameter's rows get no norm here (None): `clipping.grouped_squares` norms them all at once."""
    def reduce(g):
        kept = then(g)
        return Normed(None if is_rows(kept) else squared_norms(kept, rule, k, draws), kept)
    return reduce


def with_sum(reducer: Reducer) -> Reducer:
    """`Summed`: what `reducer` gives, and Σᵢ gᵢ for the check that the per-sample gradients add up to autograd's
    batch gradient."""
    return lambda g: Summed(reducer(g), weighted_sum_of(g, torch.ones(g.shape[0], device=g.device)))
