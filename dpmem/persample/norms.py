"""Per-sample squared gradient norms of one parameter, the first pass of two-pass clipping (FGC/GC and randomized
clipping as in DP-SGD-RC (Efficient DP-SGD for LLMs with Randomized Clipping) §4, Algorithm 2). Dense per-sample
gradients (LayerNorm, biases, replayed modules) are always normed exactly; a `Factored` one (Linear, Conv1D, Conv2d,
Embedding, tied sums) by the chosen rule:

    fgc      materialise gᵢ (B, rows, cols) for this layer only, then ‖gᵢ‖²            memory B·rows·cols
    ghost    Σ (LLᵀ ⊙ RRᵀ) from T×T Gram matrices                                  memory 2·B·T²
    mixed    whichever of the two is smaller for this layer (2T² vs rows·cols)
    hutch    ‖gᵢᵀP‖² with probes P ~ N(0, 1/k) on the larger side (k of them)         unbiased, memory B·k·(T + n)
    hutchpp  Hutch++: exact on the range Q of gᵢgᵢᵀS, Hutchinson on the rest           lower variance

The probes come from the caller's draws (`dpmem.privacy.randomness`): the Privatizer's, keyed per logical step from
the noise's secret key (the estimate's randomness is part of the mechanism, as secret as the noise).
"""

from __future__ import annotations

import math

import torch

from dpmem.persample.factored import Factored, at_least_float32
from dpmem.privacy.randomness import Draws, normal

RULES = ("fgc", "ghost", "mixed", "hutch", "hutchpp")
ESTIMATORS = ("hutch", "hutchpp")


def exact_squared_norms(g: torch.Tensor) -> torch.Tensor:
    """A fused reduction (no squared copy of g); half-precision gradients are reduced in float32."""
    g = g.unsqueeze(1) if g.dim() == 1 else g  # a scalar parameter's (B,)
    return torch.linalg.vector_norm(g, dim=tuple(range(1, g.dim())), dtype=at_least_float32(g.dtype)).pow_(2)


def ghost_is_cheaper(g: Factored) -> bool:
    """Ghost needs two T×T Gram matrices per sample, materialising needs rows×cols."""
    return 2 * g.tokens ** 2 < g.rows * g.cols


def _probes(n: int, k: int, like: torch.Tensor, draws: Draws | None) -> torch.Tensor:
    """n×k probes with N(0, 1/k) entries (variance 1/k, as the DP-SGD-RC paper's text, §6.1 and App. B have it,
    not the 1/√k printed in its Algorithm 2), so that E[PPᵀ] = I."""
    return normal(draws, (n, k), like.device, at_least_float32(like.dtype)) / math.sqrt(k)


def hutchinson(g: Factored, k: int, draws: Draws | None = None, plus_plus: bool = False):
    """Estimates of ‖gᵢ‖²_F = tr(O), O = gᵢgᵢᵀ (or gᵢᵀgᵢ: the Gram matrix of the LARGER side, so that the
    probes' product lands in the smaller one), shape (B,). Products run in the factors' dtype; sums of squares
    and the QR in at least float32."""
    left_larger = g.rows >= g.cols
    into_small = g.multiply_t if left_larger else g.multiply  # x (n_large, k) -> (B, n_small, k)
    back = g.multiply if left_larger else g.multiply_t
    n = max(g.rows, g.cols)
    like = g.terms[0][1]
    wide = at_least_float32(like.dtype)
    P = _probes(n, k, like, draws)
    sketch = into_small(P).to(wide)
    if not plus_plus:
        return sketch.pow(2).sum((1, 2))
    S = _probes(n, k, like, draws)
    Q = torch.linalg.qr(back(into_small(S)).to(wide))[0]  # (B, n, k): orthonormal basis of O·S
    del S
    head = into_small(Q).to(wide)  # tr(QᵀOQ) = ‖gᵀQ‖²
    residual = sketch - head @ (Q.transpose(1, 2) @ P)  # gᵀ(I − QQᵀ)P
    return head.pow(2).sum((1, 2)) + residual.pow(2).sum((1, 2))


def squared_norms(g, rule, k: int = 32, draws: Draws | None = None) -> torch.Tensor:
    """‖gᵢ‖² (exact, or estimated for factored gradients under an estimator rule), shape (B,). `rule`: one of
    RULES, or a function of the per-sample gradient (a broken plan's: `dpmem.audit.variants`)."""
    if callable(rule):
        return rule(g)
    if not isinstance(g, Factored):
        return exact_squared_norms(g)
    if rule in ESTIMATORS:
        return hutchinson(g, k, draws, plus_plus=rule == "hutchpp")
    if rule == "ghost" or (rule == "mixed" and ghost_is_cheaper(g)):
        return g.squared_norms()
    if rule in ("fgc", "mixed"):
        return exact_squared_norms(g.to_dense())
    raise ValueError(f"norm rule {rule!r}: allowed {', '.join(RULES)}")
