"""The model of `data=median` (dpmem.data.median): the single parameter vector β ∈ R^d, whose forward is each
example's loss fᵢ(β) = ‖β − xᵢ‖_A + (α/2)‖β‖². Its per-sample gradients come from the generic rule (the forward
replayed per sample under torch.func.vmap), as for any module that owns a bare parameter."""

from __future__ import annotations

import torch
from torch import nn

from dpmem.data.median import head_distances


class GeometricMedian(nn.Module):
    def __init__(self, A: torch.Tensor, alpha: float):
        super().__init__()
        self.beta = nn.Parameter(torch.zeros(len(A)))  # β⁽⁰⁾ = 0
        self.register_buffer("A", A.clone())  # the diagonal of A
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, d_min), the nonzero head of each example; returns the B per-sample losses."""
        return head_distances(self.beta, x, self.A) + self.alpha / 2 * self.beta.pow(2).sum()
