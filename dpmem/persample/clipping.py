"""Flat clipping's arithmetic on per-sample gradients (`Factored` or dense (B, *shape), keyed by parameter): the
per-sample norms over all parameters, the clip factors, and the weighted sum.

The per-sample gradients of vector parameters (biases, LayerNorm weights: (B, n) rows, small) are normed and summed
side by side, joined into one (B, Σn) tensor: two ops for all of them instead of a few per parameter."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from dpmem.persample.factored import Factored, weighted_sum_of
from dpmem.persample.norms import exact_squared_norms, squared_norms


def is_rows(g) -> bool:
    """A vector parameter's dense per-sample gradients, one (B, n) row per sample."""
    return isinstance(g, torch.Tensor) and g.dim() == 2


def per_sample_norms(grads: dict[nn.Parameter, torch.Tensor | Factored], rule: str = "ghost") -> torch.Tensor:
    """Flat per-sample L2 norms over all parameters: sqrt(Σ_p ‖g_p,i‖²), shape (B,); factored gradients by an
    exact `rule` of `dpmem.persample.norms` (ghost, fgc or mixed)."""
    return torch.stack([squared_norms(g, rule) for g in grads.values()]).sum(0).sqrt()


def grouped_squares(squares: dict, rows: dict) -> dict:
    """Per-sample squared norms (B,) by parameter: those already made (`squares`), and the vector parameters' rows
    not normed yet (`rows`), normed together in one op under the tuple of their parameters. Their sum over the keys
    is ‖gᵢ‖² (what `GaussianMechanism.clip_factors` takes)."""
    if rows:
        squares = {**squares, tuple(rows): exact_squared_norms(torch.cat(list(rows.values()), 1))}
    return squares


def clip_factors(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, C/‖gᵢ‖), with the same small guard against 0/0 as Opacus."""
    return (max_norm / (norms + 1e-6)).clamp(max=1.0)


def weighted_sum(grads: dict[nn.Parameter, torch.Tensor | Factored],
                 weights: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Σᵢ wᵢ gᵢ per parameter (dense)."""
    out = dict(weighted_sums(grads, weights))
    return {p: out[p] for p in grads}


def weighted_sums(grads: dict[nn.Parameter, torch.Tensor | Factored],
                  weights: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, Σᵢ wᵢ gᵢ), the rows' first (in one product), then one parameter at a time: a caller that adds
    each into a sum and drops it holds no second model-sized temporary."""
    rows: dict[torch.dtype, dict] = {}
    for p, g in grads.items():
        if is_rows(g):
            rows.setdefault(g.dtype, {})[p] = g
    for dtype, same in rows.items():
        joined = torch.mv(torch.cat(list(same.values()), 1).T, weights.to(dtype))
        yield from zip(same, joined.split([g.shape[1] for g in same.values()]))
    for p, g in grads.items():
        if not is_rows(g):
            yield p, weighted_sum_of(g, weights)
