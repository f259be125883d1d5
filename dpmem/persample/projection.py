"""A one-sided projection of a matrix parameter's gradients (DP-GRAPE, GaLore): the linear algebra that the
projected reducer applies to a layer's factors and the methods apply to dense gradients and updates."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Projection:
    """Project a matrix parameter's per-sample gradients (B, rows, cols) on one side with P (dim, r):
    side 0 gives Pᵀ·grad of shape (B, r, cols), side 1 gives grad·P of shape (B, rows, r)."""
    P: torch.Tensor
    side: int

    def project(self, g: torch.Tensor) -> torch.Tensor:
        """A (rows, cols) matrix to its projected form."""
        return self.P.T @ g if self.side == 0 else g @ self.P

    def lift(self, u: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """A projected matrix back to (rows, cols), or only the given rows of it (an FSDP shard's)."""
        whole = rows == slice(None)  # no slicing op then
        if self.side == 0:
            return (self.P if whole else self.P[rows]) @ u
        return (u if whole else u[rows]) @ self.P.T
