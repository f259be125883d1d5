"""Per-sample gradients kept as their factors. Every linear-like layer's per-sample gradient is a sum of outer
products, gᵢ = Σ_u Σ_t left_u[i,t] ⊗ right_u[i,t] (rows × cols), one term u per use of the parameter:

    nn.Linear (out, in)     left = output grad G (B, T, out), right = input A (B, T, in)
    Conv1D (in, out)        left = A, right = G
    nn.Conv2d (groups 1)    left = G (B, L, out), right = unfolded patches (B, L, in·kh·kw)
    nn.Embedding (V, D)     left = token ids (B, T) standing for one-hot rows, right = G (B, T, D)

A tied weight (RoBERTa's LM head is its word embeddings) is one `Factored` with a term per use. From the factors
the (B, rows, cols) tensor is never needed: norms come from T×T Gram matrices (ghost clipping) or from random
probes (Hutchinson, `dpmem.persample.norms`), clipped sums from one (rows, cols) product. Static shapes
throughout, so it runs on the meta device.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import reduce

import torch

from dpmem.persample.projection import Projection


def _is_ids(side: torch.Tensor) -> bool:
    return side.dim() == 2  # (B, T) integer rows; a dense side is (B, T, n)


def batch_rows(t: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """A layer's input or output gradient as (B, T, n): any middle dims flattened into T."""
    if t.dim() != 3 or t.shape[0] != batch:  # every op on the hot path costs host time: none when already so
        t = t.reshape(batch, -1, t.shape[-1])
    return t.to(dtype)


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """torch.promote_types(dtype, float32), without dispatching an op."""
    return dtype if dtype == torch.float64 else torch.float32


def apply(side: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """side (B, T, n) or ids (B, T) times x of shape (n, k) or (B, n, k): (B, T, k)."""
    if not _is_ids(side):
        return side @ x.to(side.dtype)
    if x.dim() == 2:
        return x[side]
    return torch.gather(x, 1, side.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def apply_t(side: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    """sideᵀ y per sample: side (B, T, n) or ids (B, T), y (B, T, k) -> (B, n, k)."""
    if not _is_ids(side):
        return torch.bmm(side.transpose(1, 2), y.to(side.dtype))
    out = torch.zeros(y.shape[0], n, y.shape[-1], dtype=y.dtype, device=y.device)
    return out.scatter_add_(1, side.unsqueeze(-1).expand(-1, -1, y.shape[-1]), y)


def gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample a bᵀ for two sides of the same dimension (dense or ids): (B, Ta, Tb)."""
    if _is_ids(a) and _is_ids(b):
        return (a.unsqueeze(2) == b.unsqueeze(1)).float()
    if _is_ids(a):
        return gram(b, a).transpose(1, 2)
    if _is_ids(b):  # (a one-hotᵀ)[t, t'] = a[t, ids[t']]
        return torch.gather(a, 2, b.unsqueeze(1).expand(-1, a.shape[1], -1))
    return torch.bmm(a, b.transpose(1, 2))


def _total(parts):
    """Sum without `sum`'s leading 0 (0 + t copies t: a whole B×rows×cols tensor for fgc)."""
    return reduce(operator.add, parts)


def _scaled(side: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each sample's rows of a dense side (B, T, n) times its weight."""
    return side * weights.to(side.dtype).view(-1, 1, 1)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if _is_ids(t) else t.to(at_least_float32(t.dtype))


@dataclass
class Factored:
    terms: list[tuple[torch.Tensor, torch.Tensor]]  # (left, right) per use
    rows: int
    cols: int
    param_shape: torch.Size  # the parameter's own shape (Conv2d kernels are (out, in, kh, kw))

    @classmethod
    def outer(cls, left: torch.Tensor, right: torch.Tensor, rows: int | None = None,
              param_shape: torch.Size | None = None) -> "Factored":
        """One use. `rows` is needed when `left` holds ids (the number of embedding rows)."""
        rows = left.shape[-1] if rows is None else rows
        cols = right.shape[-1]
        return cls([(left, right)], rows, cols, torch.Size(param_shape or (rows, cols)))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.terms[0][1].shape[0], *self.param_shape))

    @property
    def device(self) -> torch.device:
        return self.terms[0][1].device

    @property
    def sparse(self) -> bool:
        """Some use is an embedding's ids: the dense form would be (B, vocab, D), mostly zeros."""
        return any(_is_ids(left) for left, _ in self.terms)

    @property
    def tokens(self) -> int:
        """Positions summed over, across all uses (the T of the T×T Gram matrices)."""
        return sum(right.shape[1] for _, right in self.terms)

    def to_dense(self) -> torch.Tensor:
        dense = _total(apply_t(left, right, self.rows) for left, right in self.terms)
        return dense.reshape(self.shape)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """Σᵢ wᵢ gᵢ as one (param_shape) tensor, never (B, rows, cols): (w ⊙ left)ᵀ right over all B·T positions,
        the weights applied to the narrower side (ids: to the dense one)."""
        out = None
        for left, right in self.terms:
            if _is_ids(left):
                part = torch.zeros(self.rows, self.cols, dtype=right.dtype, device=right.device)
                part.index_add_(0, left.flatten(), _scaled(right, weights).flatten(0, 1))
            elif left.shape[-1] <= right.shape[-1]:
                part = torch.mm(_scaled(left, weights).flatten(0, 1).T, right.flatten(0, 1))
            else:
                part = torch.mm(left.flatten(0, 1).T, _scaled(right, weights).flatten(0, 1))
            out = part if out is None else out.add_(part)
        return out if out.shape == self.param_shape else out.reshape(self.param_shape)

    def squared_norms(self) -> torch.Tensor:
        """Exact ‖gᵢ‖² = Σ_{u,v} Σ_{t,t'} (L_u L_vᵀ)_{tt'} (R_u R_vᵀ)_{tt'}, shape (B,): ghost clipping."""
        terms = [(_fp32(left), _fp32(right)) for left, right in self.terms]
        total = None
        for u, (lu, ru) in enumerate(terms):
            for v in range(u, len(terms)):
                lv, rv = terms[v]
                left, right = gram(lu, lv), gram(ru, rv)
                if left.dtype != right.dtype:  # id Grams are float32
                    left, right = left.double(), right.double()
                cross = left.mul_(right).sum((1, 2))  # in place in the fresh Gram: no third T×T tensor
                cross = cross if u == v else cross.mul_(2)
                total = cross if total is None else total.add_(cross)
        return total

    def multiply_t(self, x: torch.Tensor) -> torch.Tensor:
        """gᵢᵀ x for x (rows, k) or (B, rows, k): (B, cols, k)."""
        return _total(apply_t(right, apply(left, x), self.cols) for left, right in self.terms)

    def multiply(self, y: torch.Tensor) -> torch.Tensor:
        """gᵢ y for y (cols, k) or (B, cols, k): (B, rows, k)."""
        return _total(apply_t(left, apply(right, y), self.rows) for left, right in self.terms)

    def project(self, projection: Projection) -> "Factored":
        """Pᵀgᵢ (side 0) or gᵢP (side 1) of a matrix parameter, still factored: P applied to one side of each
        term (to ids, P's rows)."""
        P, side = projection.P, projection.side
        if side == 0:
            terms = [(apply(left, P), right) for left, right in self.terms]
            rows, cols = P.shape[1], self.cols
        else:
            terms = [(left, apply(right, P)) for left, right in self.terms]
            rows, cols = self.rows, P.shape[1]
        return Factored(terms, rows, cols, torch.Size((rows, cols)))

    def add_to_(self, dense: torch.Tensor) -> torch.Tensor:
        """dense (B, *param_shape) += these per-sample gradients, in place: no second (B, rows, cols) tensor."""
        flat = dense.view(dense.shape[0], self.rows, self.cols)
        for left, right in self.terms:
            if _is_ids(left):  # row ids[i, t] of sample i gets right[i, t]
                flat.scatter_add_(1, left.unsqueeze(-1).expand(-1, -1, self.cols), right.to(flat.dtype))
            else:
                flat.baddbmm_(left.transpose(1, 2).to(flat.dtype), right.to(flat.dtype))
        return dense

    def __add__(self, other):
        """Two factored uses of a tied weight concatenate their terms; a dense use densifies (the norm needs the
        sum of both parts). `add_to_` does the latter without a copy."""
        if isinstance(other, Factored):
            return Factored(self.terms + other.terms, self.rows, self.cols, self.param_shape)
        return self.to_dense() + other

    __radd__ = __add__


def weighted_sum_of(g: torch.Tensor | Factored, weights: torch.Tensor) -> torch.Tensor:
    """Σᵢ wᵢ gᵢ of one parameter's per-sample gradients, Factored or dense (B, *shape): a dense tensor."""
    if isinstance(g, Factored):
        return g.weighted_sum(weights)
    rows = g if g.dim() == 2 else g.reshape(g.shape[0], -1)  # (B, n): no reshape op when it is already
    total = torch.mv(rows.T, weights.to(g.dtype))
    return total if g.dim() == 2 else total.view(g.shape[1:])
