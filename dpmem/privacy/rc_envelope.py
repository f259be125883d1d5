"""Privacy of DP-SGD with randomized clipping (DP-SGD-RC (Efficient DP-SGD for LLMs with Randomized Clipping) §5,
App. B.6-B.9).

The clipping factor min(1, C/R) uses a Hutchinson (Hutch) or Hutch++ estimate R² of a sample's squared gradient
norm, so the differing sample's contribution has norm at most C·Z with 1/Z² = X(λ) = Σ_j λ_j X_j,
X_j ~ χ²(k)/k i.i.d. and λ on the simplex (the eigenvalue weights of the sample's gradient, d of them). The worst
case over λ is a random variable Y whose CDF is the envelope f(x) = sup_λ P(X(λ) ≤ x) (Prop. 5.2), and one step is
a Gaussian mechanism with noise std σ (in units of C) and random sensitivity 1/√Y.

Accounting (the model of the DP-SGD-RC paper's Thm. 5.1 / Alg. 5): the sensitivity A = 1/√Y is revealed to the
adversary, so one step's pair is (A, N(A, σ²)) vs (A, N(0, σ²)) and, with Poisson sampling, its hockey-stick divergence
δ(ε) is the A-average of the sampled Gaussian's, which grows with the sensitivity for every ε in both add/remove
directions (N(s) vs N(0) is a post-processing of N(s') vs N(0) for s < s'). Any law stochastically larger than A
therefore gives an upper bound. The mixture's δ(ε) is evaluated in closed form on dp-accounting's loss grid and made
into a pessimistic PLD by connect-the-dots (exact at the grid points, an upper bound between them), which dp-accounting
composes by FFT: Alg. 5's PRV composition, on dp-accounting's PLD. Not used: MixtureGaussianPrivacyLoss (in
dp-accounting 0.6; sampling enters as a sensitivity-0 component, add and remove are both built) hides A from the
adversary, which is tighter but is not what the paper computes, and that the envelope dominates in that model is not
argued there.

Conservative discretisation of Y: bin edges y_0 < ... < y_M, each bin's mass f(y_{m+1}) - f(y_m) gets the
sensitivity of its LOWER edge 1/√y_m, the mass above y_M gets 1/√y_M, and the lower tail Y ≤ y_0 (mass
f(y_0) ≤ TAIL_MASS) gets infinite sensitivity: in the PLD that is a per-step +inf loss of probability q·f(y_0),
union-bounded over the steps by the composition (its share of δ is at most steps·q·TAIL_MASS). Components whose
sensitivity exceeds S_CAP noise standard deviations are treated as infinite too, and the PLD grid may leave out a
GRID_SHARE of δ over all steps (as +inf loss, see rc_pld).

Envelope (Hutch). x ≤ 1: χ²(k)/k (λ = e); x ≥ x₊: χ²(kd)/(kd) (λ = u); between, the sup over two-level
weights (i coordinates at λ/i, j at (1-λ)/j), the paper's Prop. 5.2. Computed here (see x_plus):
  * u stops being a local maximum exactly at 1 + 2/(dk): with S = Σ X_j, the second-order change of
    P(X(u + Δ) ≤ x) is proportional to φ'(dx), φ(s) = s² p_S(s) ∝ s^{dk/2+1} e^{-ks/2}, whose maximum is at
    s = d + 2/k. That is the paper's asymptotic x₊, but it is a local statement;
  * far from u, one spike plus a uniform rest, λ X_1 + (1 - λ) V_{d-1}, keeps beating u beyond it, and x₊ is
    where the last such configuration crosses u. (x₊ - 1)·dk is 2 only at d = 2 (2.11 at d = 3, 2.27 at d = 4,
    39.5 at d = 2048 for k = 32), not ≈ 2 throughout as the paper's Fig. 7 reports: x₊ is at least the crossing of
    χ²(k)/k and χ²(kd)/(kd), ≈ 1 + 0.67/(k√d), so the product grows like √d.
Over all two-level configurations for d ≤ EXHAUSTIVE_D (O(d²) of them); above that only (1, d-1), the maximiser
found by the exhaustive search (tests check it against the exhaustive search at larger d).
Hutch++ (adversary knows the head): f(x) = max(F(x; χ²(k)/k), 1{x ≥ 1}), i.e. Y = min(X_1, 1); it is the d → ∞
limit of the Hutch envelope and bounds it from above for every d.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from numpy.polynomial.legendre import leggauss
from scipy import optimize, special

ESTIMATORS = ("hutch", "hutchpp")
EXHAUSTIVE_D = 8  # up to this d the middle region searches every two-level configuration
TAIL_MASS = 1e-13  # envelope mass below the lowest bin: infinite sensitivity (see the module docstring)
S_CAP = 10.0  # sensitivities beyond S_CAP noise standard deviations count as infinite
GRID_SHARE = 1e-3  # share of δ that the steps' PLD grids may leave out (into +inf), see rc_pld
GEOMETRIC_RATIO = 1.005  # bin width in y: the sensitivity is overstated by at most 0.25%
MAX_BINS = 1000  # per region; small k (heavy lower tail) gets wider bins
MIDDLE_BINS = 8  # bins in (1, x₊), their CDF from the two-level search
# Quadrature error of two_level_cdf is ~1e-12; a configuration must beat u by more than this to count
EXCESS_TOL = 1e-10
MIDDLE_MARGIN = 1e-9  # added to the searched middle-region CDF before it is used as an upper bound

_GL_X, _GL_W = leggauss(64)
_S = 0.5 * (_GL_X + 1)
_SMOOTH, _SMOOTH_D, _W = _S * _S * (3 - 2 * _S), 6 * _S * (1 - _S), 0.5 * _GL_W
_TAIL = 1e-17
_LAMBDA_TAILS = np.logspace(-8, -0.3, 60)
_LAMBDAS = np.unique(np.concatenate([np.linspace(0, 1, 101), _LAMBDA_TAILS, 1 - _LAMBDA_TAILS]))  # _best_lambda's grid


def check_args(k, d, estimator: str = "hutch") -> None:
    """k: a positive integer; d: a positive integer or math.inf (the d → ∞ envelope, see _limit)."""
    for name, v in (("k", k), ("d", d)):
        if name == "d" and v == math.inf:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer" + (" or math.inf" if name == "d" else ""))
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator {estimator!r}: allowed {', '.join(ESTIMATORS)}")


def chi2_mean_cdf(x, n: float):
    """CDF of χ²(n)/n (mean 1) at x."""
    return special.gammainc(n / 2, np.maximum(np.asarray(x, float), 0.0) * n / 2)


def _log_gamma_pdf_mean1(u, shape: float):
    """log density of Gamma(shape)/shape at u, stable for shapes up to ~1e9 (d·k/2 can be that large)."""
    if shape < 1e4:
        return (shape - 1) * np.log(u) - shape * (u - 1) + shape * math.log(shape) - shape - special.gammaln(shape)
    # Stirling for the constant, log1p for the rest: the direct form loses ~1e-16·shape·log(shape)
    t = u - 1
    const = 0.5 * math.log(shape / (2 * math.pi)) - 1 / (12 * shape) + 1 / (360 * shape ** 3)
    return shape * (np.log1p(t) - t) - np.log1p(t) + const


def _narrow_wide_cdf(x: float, a, b, na: float, nb: float):
    """E[F_B((x - a·A)/b)] for A = Gamma(na)/na (the narrower part), B = Gamma(nb)/nb, weights a > 0, b > 0."""
    u_lo = special.gammaincinv(na, _TAIL) / na
    u_hi = np.minimum(special.gammainccinv(na, _TAIL) / na, x / a)  # beyond x/a the integrand is 0
    span = np.maximum(u_hi - u_lo, 0.0)
    # smoothstep substitution: the density (shape 1/2 at k = 1) and F_B near 0 both have √ end points
    u = u_lo + span[:, None] * _SMOOTH
    dens = np.exp(_log_gamma_pdf_mean1(u, na))
    fb = chi2_mean_cdf((x - a[:, None] * u) / b[:, None], 2 * nb)
    return np.sum(_W * span[:, None] * _SMOOTH_D * dens * fb, axis=1)


def two_level_cdf(x: float, lam, i: int, j: int, k: int):
    """P(λ·χ²(ik)/(ik) + (1-λ)·χ²(jk)/(jk) ≤ x) for an array of λ in [0, 1].

    Quadrature over the part with the smaller spread, so that the other part's CDF is smooth on the integration
    scale; 64 Gauss-Legendre nodes reach ~1e-12 against scipy's quad and exact χ² laws."""
    lam = np.atleast_1d(np.asarray(lam, float))
    wa, wb, na, nb = lam, 1 - lam, i * k / 2, j * k / 2
    a_narrow = wa * math.sqrt(1 / i) <= wb * math.sqrt(1 / j)
    out = np.empty_like(lam)
    for mask, (a, b, n_a, n_b) in ((a_narrow, (wa, wb, na, nb)), (~a_narrow, (wb, wa, nb, na))):
        if not mask.any():
            continue
        a_m, b_m = a[mask], b[mask]
        res = chi2_mean_cdf(x / b_m, 2 * n_b)  # narrow part has weight 0
        pos = a_m > 0
        if pos.any():
            res[pos] = _narrow_wide_cdf(x, a_m[pos], b_m[pos], n_a, n_b)
        out[mask] = res
    return out


def _configurations(d: int):
    if d <= EXHAUSTIVE_D:
        return [(i, j) for i in range(1, d + 1) for j in range(i, d - i + 1)]
    return [(1, d - 1)]


def _best_lambda(x: float, i: int, j: int, k: int) -> float:
    """max over λ of two_level_cdf: a grid, then Brent between the grid neighbours of the best point."""
    vals = two_level_cdf(x, _LAMBDAS, i, j, k)
    m = int(np.argmax(vals))
    lo, hi = _LAMBDAS[max(m - 1, 0)], _LAMBDAS[min(m + 1, len(_LAMBDAS) - 1)]
    res = optimize.minimize_scalar(lambda t: -two_level_cdf(x, t, i, j, k)[0], bounds=(lo, hi),
                                   method="bounded", options={"xatol": 1e-6 * (hi - lo)})
    return max(float(vals[m]), -float(res.fun))


def middle_cdf(x: float, k: int, d: int) -> float:
    """sup over the searched two-level configurations of P(X(λ) ≤ x) (the envelope on (1, x₊))."""
    return max(_best_lambda(x, i, j, k) for i, j in _configurations(d))


@functools.lru_cache(maxsize=None)
def x_plus(k: int, d: int) -> float:
    """The point above which the uniform weights give the envelope (Alg. 3, corrected).

    The paper's Alg. 3 bisects on [1, 2] with the test F(x; X(u)) > 1/2 (as printed), which is true on all of [1, 2]
    (the median of χ²(kd)/(kd) is below 1). Here the test is the one its early stop implies: x ≥ x₊ exactly when
    no configuration beats u at x (single crossing, the paper's Thm. B.4). u is beaten below 1 + 2/(dk) (see the module
    docstring), so the bisection runs on [1 + 2/(dk), 2] and returns the upper end (a value ≥ x₊)."""
    check_args(k, d)
    if d == 1 or d == math.inf:  # x₊ - 1 ≈ 0.67/(k√d) at least (module docstring), → 0
        return 1.0

    def beaten(x: float) -> bool:
        return middle_cdf(x, k, d) > float(chi2_mean_cdf(x, k * d)) + EXCESS_TOL

    lo, hi = 1 + 2 / (d * k), 2.0
    if not beaten(lo):
        return lo
    if beaten(hi):
        raise RuntimeError(f"x_plus(k={k}, d={d}): u is still beaten at x = 2, against DP-SGD-RC Prop. B.9")
    while hi - lo > max(1e-6 * (lo - 1), 1e-14):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if beaten(mid) else (lo, mid)
    return hi


def _limit(d, estimator: str) -> str:
    """As d → ∞ the Hutch envelope tends to Hutch++'s (χ²(k)/k below 1, 1 from 1 on: χ²(kd)/(kd) → 1{x ≥ 1}), which
    is also the exact envelope once an exactly normed part can carry all the weight (dpmem.methods.rc)."""
    return "hutchpp" if d == math.inf else estimator


def envelope_cdf(x, k: int, d, estimator: str = "hutch"):
    """f(x) = sup_λ P(X(λ) ≤ x), the CDF of the dominating Y (DP-SGD-RC Prop. 5.2, Thm. 5.1), vectorised over x."""
    check_args(k, d, estimator)
    estimator = _limit(d, estimator)
    x = np.asarray(x, float)
    fe = chi2_mean_cdf(x, k)
    if estimator == "hutchpp":
        return np.where(x >= 1, 1.0, fe)
    xp = x_plus(k, d)  # 1 for d = 1: χ²(k)/k throughout
    out = np.where(x <= 1, fe, chi2_mean_cdf(x, k * d))
    mid = (x > 1) & (x < xp)
    if mid.any():
        out[mid] = np.maximum(out[mid], [middle_cdf(float(v), k, d) for v in x[mid]])
    return out


def _edges(lo: float, hi: float) -> np.ndarray:
    """Geometric bin edges on [lo, hi]: ratio GEOMETRIC_RATIO, coarser if that needs over MAX_BINS edges (the
    heavy lower tails of small k span tens of decades)."""
    ratio = max(GEOMETRIC_RATIO, (hi / lo) ** (1 / MAX_BINS))
    return np.exp(np.linspace(math.log(lo), math.log(hi), max(2, math.ceil(math.log(hi / lo) / math.log(ratio)) + 1)))


@functools.lru_cache(maxsize=None)
def sensitivity_law(k: int, d, estimator: str = "hutch") -> tuple[np.ndarray, np.ndarray, float]:
    """A discrete law stochastically larger than the sensitivity 1/√Y: (sensitivities, masses, mass at +inf), Y
    binned as the module's docstring says, with upper bounds F_m ≥ f(y_m) of the envelope at the edges y_m."""
    check_args(k, d, estimator)
    estimator = _limit(d, estimator)
    y_lo = float(special.gammaincinv(k / 2, TAIL_MASS)) * 2 / k
    low = _edges(y_lo, 1.0)
    ys, cdfs = [low], [chi2_mean_cdf(low, k)]
    if estimator == "hutch":
        n = k * d  # above x_+ the envelope is the chi2(kd)/(kd) law (d = 1: chi2(k)/k throughout)
        xp = x_plus(k, d)
        if xp > 1:
            mid = np.linspace(1.0, xp, MIDDLE_BINS + 1)[1:-1]
            ys.append(mid)
            cdfs.append(np.array([middle_cdf(float(m), k, d) + MIDDLE_MARGIN for m in mid]))
        high = _edges(xp, max(float(special.gammainccinv(n / 2, TAIL_MASS)) * 2 / n, xp * GEOMETRIC_RATIO))
        ys.append(high)
        cdfs.append(chi2_mean_cdf(high, n))
    # hutchpp: Y = min(X_1, 1), so the last edge 1 carries the atom 1 - F(1; chi2(k)/k)
    y, cdf = np.concatenate(ys), np.concatenate(cdfs)
    order = np.lexsort((cdf, y))  # at equal y keep the largest CDF value
    y, cdf = y[order], cdf[order]
    keep = np.append(y[1:] > y[:-1], True)
    y, cdf = y[keep], np.clip(np.maximum.accumulate(cdf[keep]), 0.0, 1.0)
    mass = np.diff(np.append(cdf, 1.0))
    nz = mass > 0
    return 1 / np.sqrt(y[nz]), mass[nz], float(cdf[0])


def _gaussian_delta(c, s):
    """Hockey-stick divergence of N(s, 1) vs N(0, 1) at ε = c (Balle & Wang 2018), broadcast over c and s."""
    return special.ndtr(s / 2 - c / s) - np.exp(c + special.log_ndtr(-s / 2 - c / s))


def _mixture_deltas(eps: np.ndarray, s: np.ndarray, w: np.ndarray, w_inf: float, q: float, remove: bool):
    """δ(ε) of the Poisson-sampled Gaussian with revealed sensitivity: s (noise units) with masses w, +inf with w_inf.

    Remove: δ = q·Σ w·δ_G(c; s), c = log(1 + (e^ε - 1)/q), for ε > log(1 - q) (else 1 - e^ε).
    Add: δ = (1 - (1 - q)e^ε)·Σ w·δ_G(-c'; s), c' = log(1 + (e^-ε - 1)/q), for ε < -log(1 - q) (else 0).
    δ_G(·; inf) = 1. Same values as dp-accounting's GaussianPrivacyLoss.get_delta_for_epsilon, vectorised."""
    out = np.zeros_like(eps)
    if remove:
        live = eps > math.log1p(-q)
        out[~live] = -np.expm1(eps[~live])
        c = np.log1p(np.expm1(eps[live]) / q)
    else:
        live = eps < -math.log1p(-q)
        c = -np.log1p(np.expm1(-eps[live]) / q)
    inner = np.full(c.shape, w_inf)
    for start in range(0, len(s), 128):  # bounded memory: (chunk, grid) arrays
        sl = slice(start, start + 128)
        inner += w[sl] @ _gaussian_delta(c[None, :], s[sl, None])
    out[live] = inner * (q if remove else -np.expm1(eps[live] + math.log1p(-q)))
    return np.clip(out, 0.0, 1.0)


def _connect_dots(eps_lo: float, eps_hi: float, h: float, deltas_fn):
    lo, hi = math.floor(eps_lo / h), math.ceil(eps_hi / h)
    deltas = deltas_fn(np.arange(lo, hi + 1) * h)
    return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(h, lo, hi, np.minimum.accumulate(deltas))


def rc_pld(sigma: float, sample_rate: float, sensitivities: np.ndarray, masses: np.ndarray, inf_mass: float,
           discretization: float, tail_mass: float) -> PrivacyLossDistribution:
    """One step's pessimistic PLD: Poisson-sampled Gaussian (std sigma) with a revealed random sensitivity.

    The loss grid leaves out at most `tail_mass` of probability per direction: beyond its upper end it becomes
    +inf loss (connect-the-dots puts the exact δ at the end there), below its lower end (add) it is rounded up."""
    q = sample_rate
    s = np.asarray(sensitivities, float) / sigma
    w = np.asarray(masses, float)
    capped = s > S_CAP
    w_inf = inf_mass + float(w[capped].sum())
    s, w = s[~capped], w[~capped]
    # component m keeps all but tail_mass/(2·len(s)) of its mass between its N(0,1) quantiles ±z_m
    z = -special.ndtri(np.minimum(0.5, tail_mass / (2 * max(len(s), 1) * np.maximum(w, 1e-300))))
    eps_lo = -math.log1p(q * math.expm1(float(np.max(s * z - s * s / 2, initial=0.0))))
    eps_max = math.log1p(q * math.expm1(float(np.max(s * s / 2 + s * z, initial=0.0))))
    # upper end: the first point where the finite components' δ is below tail_mass (often well before eps_max)
    probe = np.linspace(0.0, eps_max, 65)[1:]
    ok = _mixture_deltas(probe, s, w, w_inf, q, remove=True) <= q * w_inf + tail_mass
    eps_hi = float(probe[np.argmax(ok)]) if ok.any() else eps_max
    remove = _connect_dots(math.log1p(-q), eps_hi, discretization,
                           lambda e: _mixture_deltas(e, s, w, w_inf, q, remove=True))
    add = _connect_dots(eps_lo, -math.log1p(-q), discretization,
                        lambda e: _mixture_deltas(e, s, w, w_inf, q, remove=False))
    return PrivacyLossDistribution(remove, add)


def rc_epsilon(sigma: float, delta: float, sample_rate: float, steps: int, k: int, d,
               estimator: str = "hutch", discretization: float = 1e-3, loss_noise: float | None = None) -> float:
    """ε after `steps` Poisson-sampled DP-SGD-RC steps (add/remove) with noise multiplier sigma. `loss_noise`: each
    step also releases the batch's clipped loss sum with a noise multiplier loss_noise·sigma (dpmem.privacy.
    accounting): a second coordinate of sensitivity 1/loss_noise (in units of sigma) beside the random one."""
    sens, masses, inf_mass = sensitivity_law(k, d, estimator)
    if loss_noise is not None:
        sens = np.sqrt(sens ** 2 + loss_noise ** -2)
    pld = rc_pld(sigma, sample_rate, sens, masses, inf_mass, discretization, GRID_SHARE * delta / steps)
    return float(pld.self_compose(steps).get_epsilon_for_delta(delta))
