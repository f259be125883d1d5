"""Flat clipping's arithmetic on per-sample gradients (`Factored` or dense (B, *shape), keyed by parameter): the
per-sample norms over all parameters, the clip factors, and the weighted sum."""

from __future__ import annotations

import torch
from torch import nn

from dpmem.persample.factored import Factored, weighted_sum_of
from dpmem.persample.norms import squared_norms


def per_sample_norms(grads: dict[nn.Parameter, torch.Tensor | Factored], rule: str = "ghost") -> torch.Tensor:
    """Flat per-sample L2 norms over all parameters: sqrt(Σ_p ‖g_p,i‖²), shape (B,); factored gradients by an
    exact `rule` of `dpmem.persample.norms` (ghost, fgc or mixed)."""
    return torch.stack([squared_norms(g, rule) for g in grads.values()]).sum(0).sqrt()


def clip_factors(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, C/‖gᵢ‖), with the same small guard against 0/0 as Opacus."""
    return (max_norm / (norms + 1e-6)).clamp(max=1.0)


def weighted_sum(grads: dict[nn.Parameter, torch.Tensor | Factored],
                 weights: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Σᵢ wᵢ gᵢ per parameter (dense)."""
    return {p: weighted_sum_of(g, weights) for p, g in grads.items()}
