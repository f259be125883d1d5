"""Private hyperparameter selection (Papernot & Steinke, "Hyperparameter tuning with Renyi differential privacy",
ICLR 2022, arXiv 2110.03620): run a random search whose number of trials K is itself random and secret, and release
only the best trial. Its ε is that of dp-accounting's RepeatAndSelectDpEvent under the RDP accountant, a small
multiple of one run's, where the best of K runs each accounted alone costs all K composed.

The law of K has a mean μ ≥ 1 and a shape η ≥ 0 (the paper's truncated negative binomial, TNB(η, γ)):

    0 < η < ∞   P[K = k] = (1 - γ)^k / (γ^-η - 1) · Γ(k + η) / (Γ(k + 1) Γ(η)),   k ≥ 1
    η = 1       geometric: P[K = k] = γ (1 - γ)^(k - 1)
    η = 0       logarithmic: P[K = k] = (1 - γ)^k / (k ln(1/γ))
    η = ∞       Poisson: P[K = k] = e^-μ μ^k / k!,   k ≥ 0 (K = 0: nothing is released)

γ is set by μ (`gamma`). K is drawn from a key of 256 secret bits (`draw_trials`), never from a seed a config
holds."""

from __future__ import annotations

import functools
import math

import dp_accounting
import numpy as np
from dp_accounting import dp_event, rdp

from dpmem.privacy.accounting import MAX_SIGMA, RELATIONS, _bracket, _check, _event, joint_sigma

POISSON = math.inf
LAWS = {0.0: "logarithmic", 1.0: "geometric", POISSON: "Poisson"}  # other shapes: truncated negative binomial


def law(shape: float) -> str:
    return LAWS.get(shape, f"truncated negative binomial (shape {shape:g})")


MAX_MEAN = 10_000  # a search's trials each train a model: more on average is a slip of the keyboard (1e9)


def check_law(mean: float, shape: float) -> None:
    if not math.isfinite(mean) or mean < 1:
        raise ValueError(f"mean_trials={mean}: must be a number of at least 1")
    if mean > MAX_MEAN:
        raise ValueError(f"mean_trials={mean:g}: at most {MAX_MEAN:,} (each trial trains a model)")
    if math.isnan(shape) or shape < 0:
        raise ValueError(f"shape={shape}: must be at least 0 (0 logarithmic, 1 geometric, inf Poisson)")


def _tnb_mean(gamma: float, shape: float) -> float:
    if shape == 1:
        return 1 / gamma
    if shape == 0:
        return (1 - gamma) / (gamma * math.log(1 / gamma))
    return shape * (1 - gamma) / (gamma * (1 - gamma ** shape))


@functools.lru_cache(maxsize=64)
def gamma(mean: float, shape: float) -> float:
    """TNB's γ for mean μ, by bisection to 1e-12 (relative); of the two ends, the one whose mean is at least μ, as
    dp-accounting's accountant takes it (the conservative end: more trials, not fewer)."""
    if shape == 1:
        return 1 / mean
    if mean == 1:
        return 1.0
    lo, hi = 0.0, min(1.0, 2 * (shape + 1) / mean)  # the mean falls from ∞ at γ = 0 to 1 at γ = 1
    while hi > lo * (1 + 1e-12):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _tnb_mean(mid, shape) < mean else (mid, hi)
    return lo


def pmf(k: int, mean: float, shape: float) -> float:
    """P[K = k] under the law (mean, shape)."""
    if shape == POISSON:
        return math.exp(k * math.log(mean) - mean - math.lgamma(k + 1)) if k >= 0 else 0.0
    if k < 1:
        return 0.0
    g = gamma(mean, shape)
    if g == 1.0:
        return 1.0 if k == 1 else 0.0
    if shape == 0:
        return math.exp(k * math.log1p(-g) - math.log(k) - math.log(math.log(1 / g)))
    log_binomial = math.lgamma(k + shape) - math.lgamma(k + 1) - math.lgamma(shape)
    return math.exp(k * math.log1p(-g) + log_binomial - math.log(math.expm1(-shape * math.log(g))))


def draw_trials(mean: float, shape: float, key: bytes) -> int:
    """K, by inverting the law's distribution function at a uniform drawn from `key` (256 secret bits)."""
    check_law(mean, shape)
    u = np.random.Generator(np.random.PCG64DXSM(int.from_bytes(key, "little"))).random()
    k = 0 if shape == POISSON else 1
    total = pmf(k, mean, shape)
    while total < u and total < 1 - 1e-15:
        k += 1
        total += pmf(k, mean, shape)
    return k


# ELS's step is a mixture of Gaussians (accounting._event), which only the PLD accountant composes
ELS_REFUSED = ("a private search under ELS (privacy.unit=user, privacy.user_sampling=records) has no user-level ε: "
               "dp-accounting's RDP accountant has no MixtureOfGaussiansDpEvent, and the repeat-and-select bound is "
               "RDP-only; use privacy.user_sampling=users (ULS), whose search is accounted per user")


def selection_event(sigma: float, sample_rate: float, steps: int, mean: float, shape: float,
                    sampling: str = "poisson", dataset_size: int | None = None,
                    user_records: int | None = None) -> dp_event.DpEvent:
    """The search as one DP event: each trial `steps` sampled Gaussian steps of (joint) multiplier `sigma`,
    repeated K ~ (mean, shape) times, the best released. `user_records` (ELS's k) is refused (ELS_REFUSED), never
    accounted as a record's event."""
    if user_records is not None:
        raise ValueError(ELS_REFUSED)
    return dp_event.RepeatAndSelectDpEvent(_event(sigma, sample_rate, steps, sampling, dataset_size), mean, shape)


def selection_epsilon(sigma: float, delta: float, sample_rate: float, steps: int, mean: float, shape: float,
                      neighbouring: str = "add_remove", sampling: str = "poisson",
                      dataset_size: int | None = None, user_records: int | None = None) -> float:
    """ε of the whole search (RDP), each trial's joint multiplier `sigma` (the gradient's and the loss's releases
    as one Gaussian: accounting.joint_sigma)."""
    _check(delta, sample_rate, steps)
    check_law(mean, shape)
    accountant = rdp.RdpAccountant(neighboring_relation=RELATIONS[neighbouring])
    event = selection_event(sigma, sample_rate, steps, mean, shape, sampling, dataset_size, user_records)
    if not accountant.supports(event):
        raise ValueError(f"the RDP accountant does not support {sampling} sampling under {neighbouring}")
    return float(accountant.compose(event).get_epsilon(delta))


def calibrate_selection(epsilon: float, delta: float, sample_rate: float, steps: int, mean: float, shape: float,
                        neighbouring: str = "add_remove", sampling: str = "poisson", dataset_size: int | None = None,
                        loss_noise: float | None = None, tolerance: float = 1e-4,
                        user_records: int | None = None) -> float:
    """The gradient's noise multiplier of every trial such that the whole search meets (epsilon, delta): the
    smallest joint multiplier whose `selection_epsilon` is at most `epsilon`, then the gradient's share of it (as
    accounting.calibrate_sigma). Raises dpmem.privacy.UnreachableTarget for a budget the law cannot meet, and
    ValueError for ELS's `user_records` (ELS_REFUSED)."""
    if not epsilon > 0:
        raise ValueError(f"epsilon={epsilon} must be > 0")
    if user_records is not None:
        raise ValueError(ELS_REFUSED)

    def eps(s: float) -> float:
        return selection_epsilon(s, delta, sample_rate, steps, mean, shape, neighbouring, sampling, dataset_size)

    lo, hi = _bracket(eps, epsilon, MAX_SIGMA, f"epsilon={epsilon:g} at delta={delta:.3g} is unreachable by a "
                      f"private selection of mean {mean:g} trials ({law(shape)}) of {steps} steps at sample rate "
                      f"{sample_rate:.4g}")
    sigma = dp_accounting.calibrate_dp_mechanism(
        lambda: rdp.RdpAccountant(neighboring_relation=RELATIONS[neighbouring]),
        lambda s: selection_event(s, sample_rate, steps, mean, shape, sampling, dataset_size),
        epsilon, delta, bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi), discrete=False,
        tol=tolerance)
    return float(sigma) / joint_sigma(1.0, loss_noise)
