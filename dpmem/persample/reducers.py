"""What a capture keeps of one parameter's per-sample gradient. A reducer is applied once the parameter's last use
in the forward pass has had its output gradient, so a weight used several times (a tied LM head) is reduced as the
sum over its uses: normed and clipped as one, never per use. It takes the per-sample gradient, `Factored`
(linear-like weights, embedding ids) or dense (B, *shape), and returns what the caller keeps; the rest is freed
then, one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

import torch

from dpmem.persample.clipping import is_rows
from dpmem.persample.factored import Factored, at_least_float32, weighted_sum_of
from dpmem.persample.norms import ESTIMATORS, exact_squared_norms, squared_norms
from dpmem.persample.projection import Projection
from dpmem.privacy.randomness import Draws

Reducer = Callable[[Any], Any]


class Normed(NamedTuple):
    """What one-pass clipping keeps of a parameter: its squared per-sample norms (B,) (None for rows), and its
    per-sample gradients (`Factored` or dense) for the clipped sum once every norm is known."""
    squares: torch.Tensor | None
    grads: Any


class Summed(NamedTuple):
    """What a reducer keeps of a parameter, and Σᵢ wᵢ gᵢ: the attribution proof's sum (for autograd's ∇Σᵢ wᵢ ℓᵢ)."""
    value: Any
    total: torch.Tensor


@dataclass(frozen=True)
class Stream:
    """A reducer whose value is tensors of shapes known before the backward pass, so that a layer's backward can
    return it (`dpmem.persample.taps` streams it there, and frees the layer's output gradient at once): squared
    per-sample norms (B,) (`kind` norms), or `Normed` dense per-sample gradients (B, *kept shape) (dense), streamed
    alone (one zero fewer per layer) and normed when unpacked (a vector parameter's rows later, all at once). Only
    for layers with float inputs unless `any_input` (an embedding's dense per-sample gradient would be B×vocab×D, so
    `materialize` keeps it factored), and only for layers whose gradient comes out dense unless `densifies`
    (book-keeping keeps a linear layer's factors: those stream as the layer's pair)."""
    reduce: Reducer  # the value, where the layer does not stream
    kept: Callable[[Any], torch.Tensor]  # what streams: the squared norms, or the dense per-sample gradients
    kind: str
    any_input: bool = True
    densifies: bool = True
    draws: bool = False  # an estimator's probes are drawn in it: a compiled backward cannot (it streams the pair)

    def __call__(self, g):
        return self.reduce(g)

    def shapes(self, batch: int, kept: torch.Size, dtype: torch.dtype, float_input: bool,
               factored: bool) -> list[tuple] | None:
        """(shape, dtype) per tensor of the value, for a parameter of `dtype` whose kept per-sample gradient is of
        shape `kept` (the rules form it in the parameter's dtype, norms in at least float32); None where this
        layer's value cannot stream."""
        if self.kind == "norms":
            return [((batch,), at_least_float32(dtype))]
        if not (float_input or self.any_input) or (factored and not self.densifies):
            return None
        return [((batch, *kept), dtype)]

    def unpack(self, parts: list) -> tuple[Any, list]:
        """(the value, the parts after its own)."""
        value = parts[0] if self.kind == "norms" else Normed(None if is_rows(parts[0]) else
                                                             exact_squared_norms(parts[0]), parts[0])
        return value, parts[1:]


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
    project = lambda g: g.project(projection(made))  # noqa: E731
    if not isinstance(then, Stream):
        return lambda g: then(project(g))
    return replace(then, reduce=lambda g: then(project(g)), kept=lambda g: then.kept(project(g)))


def norms(rule: str, k: int = 32, draws: Draws | None = None) -> Reducer:
    """Squared per-sample norms (B,) by a rule of `dpmem.persample.norms` (two-pass clipping's first pass)."""
    reduce = lambda g: squared_norms(g, rule, k, draws)  # noqa: E731
    return Stream(reduce, reduce, "norms", draws=rule in ESTIMATORS)


def normed(rule: str = "mixed", k: int = 32, draws: Draws | None = None,
           then: Reducer = lambda g: g) -> Reducer:
    """`Normed`: squared norms and what `then` keeps; one-pass clipping. By default the factors as they are
    (book-keeping), normed now (exactly, ghost or the per-sample product, whichever is smaller; or a DP-SGD-RC
    estimate) and kept for the clipped sum (c ⊙ G)ᵀA once every norm is known; with `then=materialize`, dense
    gradients. A vector parameter's rows get no norm here (None): `clipping.grouped_squares` norms them all at once."""
    def reduce(g):
        kept = then(g)
        return Normed(None if is_rows(kept) else squared_norms(kept, rule, k, draws), kept)
    return Stream(reduce, then, "dense", any_input=False, densifies=then is materialize)


def with_sum(reducer: Reducer, weights: torch.Tensor) -> Reducer:
    """`reducer`'s values, as `Summed` with Σᵢ wᵢ gᵢ (the attribution proof's, `dpmem.methods.attribution`)."""
    return lambda g: Summed(reducer(g), weighted_sum_of(g, weights))


def joined(g, k: int):
    """Per-record gradients (B = U·k records, k to a user, user after user) as per-user sums (U): a factored one's
    sides (B, T, n) viewed as (U, k·T, n), ids (B, T) as (U, k·T), so that Σ_t over a user's joined tokens is the
    sum of its records' gradients (the ghost and book-keeping identities then norm and weigh users as they do
    samples); a dense one (B, *shape) summed over each user's k rows."""
    if isinstance(g, Factored):
        def side(t):
            return t.reshape(t.shape[0] // k, k * t.shape[1], *t.shape[2:])
        return Factored([(side(left), side(right)) for left, right in g.terms], g.rows, g.cols, g.param_shape)
    return g.reshape(g.shape[0] // k, k, *g.shape[1:]).sum(1)


def by_user(reducer: Reducer, k: int) -> Reducer:
    """`reducer` on each user's summed gradient (`joined`): ULS's per-user clipping under any clipping plan. It does
    not stream (its value is per user, not per sample)."""
    return lambda g: reducer(joined(g, k))
