"""The linear algebra of the spectrum analyses: exact top singular values of one matrix, orthogonal (subspace)
iteration over a matrix too large to hold (its rows streamed in chunks), the power-law slope of a spectrum and
the restricted-Lipschitz proxy G_k."""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch

Rows = Callable[[], Iterable[torch.Tensor]]  # a fresh pass over the row chunks of H, each (rows, p)


def top_singular_values(matrix: torch.Tensor, top: int) -> torch.Tensor:
    """The `top` largest singular values of a 2-D matrix (all of them if it has fewer), in float64."""
    return torch.linalg.svdvals(matrix.detach().to(torch.float64))[:top].cpu()


def orthogonal_iteration(rows: Rows, p: int, k: int, iterations: int, generator: torch.Generator | None = None,
                         dtype: torch.dtype = torch.float64,
                         device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k singular values of H (r × p, given by `rows`) and its top-k right singular vectors V (p × k), by orthogonal
    iteration on HᵀH (Li et al. 2022 (When Does DP Learning Not Suffer in High Dimensions?) App. B, citing [Dem97]):
    V ← orth(HᵀH V), one pass over the chunks per iteration (HᵀH V = Σ_c H_cᵀ(H_c V)), then a Rayleigh–Ritz step (SVD of
    the r × k matrix H V) that orders the directions. Memory: p × k twice, one chunk, and r × k; H itself is never held.
    `dtype`/`device`: where the p × k matrices live (float32 on a GPU for Li et al. 2022's 7M × 1000)."""
    if k < 1 or iterations < 0:
        raise ValueError(f"k={k} must be >= 1 and iterations={iterations} >= 0")
    k = min(k, p)
    v = torch.linalg.qr(torch.randn(p, k, generator=generator, dtype=dtype).to(device)).Q
    for _ in range(iterations):
        w = torch.zeros_like(v)
        for chunk in rows():
            c = chunk.to(device=device, dtype=dtype)
            w += c.T @ (c @ v)
        v = torch.linalg.qr(w).Q
    hv = torch.cat([chunk.to(device=device, dtype=dtype) @ v for chunk in rows()])  # (r, k)
    _, values, zt = torch.linalg.svd(hv, full_matrices=True)  # zt is k × k even when r < k
    values = torch.cat([values, values.new_zeros(k - len(values))])  # beyond rank r: σ = 0
    return values, v @ zt.T  # Ritz values ≈ σᵢ(H), Ritz vectors ≈ right singular vectors


def power_law_slope(values: Sequence[float] | torch.Tensor) -> tuple[float, float]:
    """Least-squares line of log σᵢ against log i (i = 1, 2, ...; zeros left out): (slope, intercept). Li et al.
    2022 fit the top 1000 and find ≈ −0.6."""
    v = torch.as_tensor(values, dtype=torch.float64).flatten()
    i = torch.arange(1, len(v) + 1, dtype=torch.float64)
    keep = v > 0
    if int(keep.sum()) < 2:
        return math.nan, math.nan
    x, y = i[keep].log(), v[keep].log()
    a = torch.stack([x, torch.ones_like(x)], dim=1)
    slope, intercept = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.flatten().tolist()
    return slope, intercept


def residual_norms(rows: Rows, v: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """G_k ≈ maxₜ ‖(I − V_k V_kᵀ) ḡₜ‖ for each k in `ks` (V's first k columns, orthonormal): the empirical proxy of
    the restricted-Lipschitz coefficient over the recorded gradients ḡₜ (the rows)."""
    ks = [k for k in ks if 0 <= k <= v.shape[1]]
    best = {k: 0.0 for k in ks}
    for chunk in rows():
        c = chunk.to(device=v.device, dtype=v.dtype)
        total = (c * c).sum(1)
        coords = c @ v  # (rows, k): coordinates in the principal directions
        captured = torch.cumsum(coords * coords, dim=1)
        for k in ks:
            inside = captured[:, k - 1] if k > 0 else torch.zeros_like(total)
            best[k] = max(best[k], float((total - inside).clamp(min=0).sqrt().max()))
    return best
