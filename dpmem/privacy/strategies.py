"""Correlated noise for DP matrix factorization (DP-FTRL, BandMF, BISR): lower-triangular Toeplitz strategies on the
prefix-sum workload.

The matrix mechanism releases g_t + σ·w_t at step t with w = C⁻¹z (z i.i.d. standard normal, one vector per step), so
the noise in the prefix sums of the releases is B z with B = A C⁻¹, A the all-ones lower-triangular matrix. C is lower-
triangular Toeplitz, given by its first column c (the strategy coefficients); C⁻¹ is too, its first column d (the
noising coefficients) being the power series 1/c(x). With C's largest column norm 1, σ stays the noise multiplier of
one participation; `Strategy.sensitivity` gives it for several.

- independent: C = I, DP-SGD's noise (every prefix sum's error grows as t).
- bandmf: C banded with b bands, c optimised for the mean squared error of the prefix sums (Choquette-Choo et al. 2023,
  "(Amplified) Banded Matrix Factorization", arXiv 2306.08153; Toeplitz BandMF: McKenna 2024, arXiv 2405.15913). A
  step's noise w_t = (z_t − Σ_{0<j<b} c_j w_{t−j}) / c_0 needs the last b − 1 noise vectors kept: memory.
- bisr: C⁻¹ banded with p bands, d the coefficients of (1 − x)^{1/2} cut to p terms (banded inverse square root:
  Kalinin & Lampert 2025, "Back to square roots", arXiv 2505.12128; the square-root factorization A = C·C it bands is
  BSR's, Kalinin & Lampert 2024, arXiv 2405.13763). A step's noise w_t = Σ_{j<p} d_j z_{t−j} regenerates the past z
  from keyed draws, so nothing is kept: compute instead of memory.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np
from scipy import optimize, signal

NAMES = ("independent", "bandmf", "bisr")


def _binomial_series(exponent: float, n: int) -> np.ndarray:
    """The first n coefficients of (1 − x)^exponent: a_k = a_{k−1}·(k − 1 − exponent)/k."""
    k = np.arange(1, n)
    return np.concatenate(([1.0], np.cumprod((k - 1 - exponent) / k)))


def _pad(coefs, n: int) -> np.ndarray:
    """A Toeplitz matrix's first column over n steps: cut, or padded with zeros."""
    out = np.zeros(n)
    head = np.asarray(coefs, dtype=np.float64)[:n]
    out[: len(head)] = head
    return out


def _inverse(coefs, n: int) -> np.ndarray:
    """The first n coefficients of 1/c(x), i.e. the inverse lower-triangular Toeplitz matrix's first column: solving
    C x = e₀ by forward substitution is the IIR filter 1/c(x) on an impulse, O(n·len(c)) in C code."""
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return signal.lfilter([1.0], np.asarray(coefs, dtype=np.float64)[:n], impulse)


def _bandmf_loss(tail: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """‖c‖² · mean_t Σ_{j≤t} B_{tj}² for c = (1, tail), and its exact gradient in `tail`.

    B's first column β solves C β = 1, and the mean is Σ_k (n − k) β_k² / n. The adjoint λ = C⁻ᵀ ∂E/∂β is a
    forward solve on the reversed vector (a lower-triangular Toeplitz matrix is persymmetric), and ∂E/∂c_j =
    −Σ_i λ_i β_{i−j}. Fixing c_0 = 1 costs nothing (the loss is scale-invariant) and removes the flat direction."""
    c = np.concatenate(([1.0], tail))
    with np.errstate(over="ignore", invalid="ignore"):
        beta = signal.lfilter([1.0], c, np.ones(n))
        weights = (n - np.arange(n)) / n
        error = weights @ beta**2
    if not np.isfinite(error):
        # a line search's step past the stable region (a root of c in the unit disc: 1/c(x) grows without bound, the
        # error overflows): a steep finite wall, so that it steps back rather than stop where it began
        return 1e100 * (1 + tail @ tail), 2e100 * tail
    adjoint = signal.lfilter([1.0], c, (2 * weights * beta)[::-1])[::-1]
    d_error = -np.array([adjoint[j:] @ beta[: n - j] for j in range(len(c))])
    norm2 = c @ c
    grad = 2 * c * error + norm2 * d_error
    return norm2 * error, grad[1:]


STEP_SCALE = 100.0  # the optimiser's variables are c × 100: its first, unit, step moves c by 0.01


@functools.lru_cache
def _bandmf_coefs(n: int, bands: int) -> tuple[float, ...]:
    """BandMF's optimal b-banded Toeplitz c for the mean squared prefix-sum error over n steps, ‖c‖ = 1.

    L-BFGS (scipy) from BSR's coefficients cut to b, with the exact O(n·b) loss and gradient of `_bandmf_loss`: a few
    dozen evaluations: about 2 ms for n = 1000, b = 16, 30 ms for n = 10,000, b = 64 and 2 s for n = 100,000,
    b = 256 on 2 CPU cores (jax-privacy's optimize_banded_toeplitz: 1.3 s and 19 s for the first two), its loss to
    1e-15, so no closed-form fallback is needed. Deterministic; cached on (n, b)."""
    if bands == 1:
        return (1.0,)
    start = _binomial_series(-0.5, bands)

    def scaled(u):  # L-BFGS-B's first step has length 1: in c, past the stable region (|c_1| < 1 for b = 2)
        loss, grad = _bandmf_loss(u / STEP_SCALE, n)
        return loss, grad / STEP_SCALE
    found = optimize.minimize(scaled, start[1:] * STEP_SCALE, jac=True, method="L-BFGS-B",
                              options={"maxiter": 1000, "ftol": 1e-15, "gtol": 1e-12, "maxcor": 20})
    c = np.concatenate(([1.0], found.x / STEP_SCALE))
    return tuple(float(v) for v in c / np.linalg.norm(c))


@dataclass(frozen=True)
class Strategy:
    """A Toeplitz strategy C for the prefix-sum workload (`make_strategy` builds one).

    Args:
        name: one of NAMES.
        bands: bandmf: C's bands b (b − 1 noise buffers); bisr: C⁻¹'s bands p (p draws per step, none kept);
            independent: 1.
        horizon: n, the steps the coefficients are made for.
        coefs: bandmf, independent: C's first column (b values, ‖c‖ = 1); bisr: C⁻¹'s first column (p values, scaled
            so that C's first n coefficients have norm 1).
    """
    name: str
    bands: int
    horizon: int
    coefs: tuple

    @property
    def buffers(self) -> int:
        """Noise vectors a step keeps from the last (memory: each is the model's size)."""
        return self.bands - 1 if self.name == "bandmf" else 0

    @property
    def draws_per_step(self) -> int:
        """Fresh standard-normal vectors a step's noise is made of (compute: bisr regenerates its past draws)."""
        return self.bands if self.name == "bisr" else 1

    def strategy_coefs(self, n: int) -> np.ndarray:
        """C's first column over n steps (what sensitivity is computed from)."""
        return _inverse(self.coefs, n) if self.name == "bisr" else _pad(self.coefs, n)

    def noising_coefs(self, n: int) -> np.ndarray:
        """C⁻¹'s first column over n steps (what a step's noise is made of)."""
        return _pad(self.coefs, n) if self.name == "bisr" else _inverse(self.coefs, n)

    def sensitivity(self, steps: int, separation: int, participations: int | None = None) -> float:
        """max ‖C u‖ over participation vectors u ∈ {0,1}^steps with at most `participations` ones (None: as many as
        fit) at least `separation` apart, for C's leading steps×steps block: what σ is multiplied by for that
        participation pattern.

        For non-negative, non-increasing coefficients the worst u is k = min(participations, ⌈steps/separation⌉)
        participations exactly `separation` apart from step 0 (Theorem 2 of arXiv 2405.13763), so that C u is k
        shifted copies of c: computed in O(steps) as a difference of strided running sums.

        Raises ValueError on steps or separation < 1, participations < 1, or coefficients that are negative or
        increase (the theorem does not hold for them)."""
        if steps < 1 or separation < 1 or (participations is not None and participations < 1):
            raise ValueError(f"sensitivity needs steps ≥ 1, separation ≥ 1 and participations ≥ 1 or None, got "
                             f"{steps=}, {separation=}, {participations=}")
        c = self.strategy_coefs(steps)
        if np.any(c < 0) or np.any(np.diff(c) > 0):
            raise ValueError(f"{self.name}'s coefficients must be non-negative and non-increasing for this bound")
        rows = math.ceil(steps / separation)  # the most participations that fit
        k = rows if participations is None else min(rows, participations)
        # running[t] = Σ_{i≥0} c[t − i·separation]: the sum down each residue class mod separation
        running = _pad(c, rows * separation).reshape(rows, separation).cumsum(axis=0).ravel()[:steps]
        u = running.copy()
        if k * separation < steps:
            u[k * separation:] -= running[: steps - k * separation]  # keep only the last k copies
        return float(np.linalg.norm(u))

    def prefix_rmse(self, n: int) -> float:
        """sqrt of the mean over n steps of the per-step squared error of the noise's prefix sums, for σ = 1 and C as
        normalised, times the single-participation sensitivity (C's largest column norm, the first's): the
        strategy's error, comparable across strategies. Step t's error is Σ_{k≤t} β_k², β = cumsum(d) the first
        column of B = A C⁻¹, so the mean is Σ_k (n − k) β_k² / n."""
        beta = np.cumsum(self.noising_coefs(n))
        mean = (n - np.arange(n)) @ beta**2 / n
        c = self.strategy_coefs(n)
        return float(math.sqrt(mean * (c @ c)))


def _is_count(value) -> bool:
    """An integer ≥ 1 (numpy's too; not a bool, not a float: a fractional band count is a mistake, not a rounding)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def make_strategy(name: str, bands: int, horizon: int) -> Strategy:
    """The strategy `name` (one of NAMES) with `bands` bands for a horizon of n = `horizon` steps.

    bands > horizon is clipped to horizon for bandmf and bisr: bands beyond the horizon are never used.

    Raises ValueError naming the allowed values: unknown name; bands < 1; independent with bands != 1; horizon < 1."""
    if name not in NAMES:
        raise ValueError(f"unknown strategy {name!r}: allowed are {', '.join(NAMES)}")
    if not _is_count(horizon):
        raise ValueError(f"horizon must be an integer ≥ 1, got {horizon!r}")
    if not _is_count(bands):
        raise ValueError(f"bands must be an integer ≥ 1, got {bands!r}")
    bands, horizon = int(bands), int(horizon)
    if name == "independent":
        if bands != 1:
            raise ValueError(f"independent noise has bands = 1 only, got {bands}")
        return Strategy(name, 1, horizon, (1.0,))
    bands = min(bands, horizon)
    if name == "bandmf":
        return Strategy(name, bands, horizon, _bandmf_coefs(horizon, bands))
    d = _binomial_series(0.5, bands)
    scale = np.linalg.norm(_inverse(d, horizon))  # C = 1/d(x) over the horizon; d·scale makes its norm 1
    return Strategy(name, bands, horizon, tuple(float(v) for v in d * scale))
