"""Privacy accounting by dp-accounting: epsilon spent for a noise multiplier, and the noise multiplier for a
target epsilon. One DP event per logical step: a sampled Gaussian mechanism with noise multiplier sigma."""

from __future__ import annotations

import math

import dp_accounting
from absl import logging as absl_logging
from dp_accounting import pld, rdp

NeighborRel = dp_accounting.NeighboringRelation
RELATIONS = {"add_remove": NeighborRel.ADD_OR_REMOVE_ONE, "replace_one": NeighborRel.REPLACE_ONE}
ACCOUNTANTS = ("pld", "rdp")
SAMPLINGS = ("poisson", "fixed")
# PLD discretisation: 1e-3 keeps a 1000-step composition under a second and errs on the pessimistic side.
PLD_DISCRETIZATION = 1e-3
MIN_SIGMA, MAX_SIGMA = 0.05, 1e3
# RDP's series for fractional orders near 1 warn and drop those orders; the result stays an upper bound.
absl_logging.set_verbosity(absl_logging.ERROR)


class UnreachableTarget(ValueError):
    pass


def _accountant(accountant: str, neighbouring: str):
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant {accountant!r}: allowed {', '.join(ACCOUNTANTS)}")
    if neighbouring not in RELATIONS:
        raise ValueError(f"neighbouring {neighbouring!r}: allowed {', '.join(RELATIONS)}")
    rel = RELATIONS[neighbouring]
    if accountant == "pld":
        return pld.PLDAccountant(rel, value_discretization_interval=PLD_DISCRETIZATION)
    return rdp.RdpAccountant(neighboring_relation=rel)


def _event(sigma: float, sample_rate: float, steps: int, sampling: str, dataset_size: int | None):
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    if sampling == "poisson":
        step = dp_accounting.PoissonSampledDpEvent(sample_rate, gaussian)
    elif sampling == "fixed":
        if dataset_size is None:
            raise ValueError("fixed-size sampling needs dataset_size")
        batch = int(round(sample_rate * dataset_size))
        step = dp_accounting.SampledWithoutReplacementDpEvent(dataset_size, batch, gaussian)
    else:
        raise ValueError(f"sampling {sampling!r}: allowed {', '.join(SAMPLINGS)}")
    return dp_accounting.SelfComposedDpEvent(step, steps)


def _check(delta: float, sample_rate: float, steps: int) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta} must be in (0, 1)")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate={sample_rate} must be in (0, 1]")
    if steps < 0:
        raise ValueError(f"steps={steps} must be >= 0")


def epsilon_spent(sigma: float, delta: float, sample_rate: float, steps: int, accountant: str = "pld",
                  neighbouring: str = "add_remove", sampling: str = "poisson",
                  dataset_size: int | None = None) -> float:
    """Epsilon after `steps` sampled Gaussian steps with noise multiplier `sigma` (inf if sigma is 0)."""
    _check(delta, sample_rate, steps)
    if steps == 0:
        return 0.0
    if sigma <= 0:
        return math.inf
    acc = _accountant(accountant, neighbouring)
    event = _event(sigma, sample_rate, steps, sampling, dataset_size)
    if not acc.supports(event):
        raise ValueError(f"accountant {accountant} does not support {sampling} sampling under {neighbouring}")
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def calibrate_sigma(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "pld",
                    neighbouring: str = "add_remove", sampling: str = "poisson",
                    dataset_size: int | None = None, tolerance: float = 1e-3) -> float:
    """The smallest noise multiplier whose epsilon after `steps` steps is at most `epsilon` (to `tolerance`)."""
    _check(delta, sample_rate, steps)
    if not epsilon > 0:
        raise ValueError(f"epsilon={epsilon} must be > 0")
    if steps <= 0:
        raise ValueError(f"steps={steps} must be positive")
    def eps(s: float) -> float:
        return epsilon_spent(s, delta, sample_rate, steps, accountant, neighbouring, sampling, dataset_size)

    # Bracket by doubling/halving from sigma = 1. Below MIN_SIGMA a PLD needs ~1/sigma^2 buckets (memory), and
    # no DP training runs there; above MAX_SIGMA the target is refused as unreachable.
    lo, hi = 1.0, 1.0
    while eps(hi) > epsilon:
        lo, hi = hi, hi * 2
        if hi > MAX_SIGMA:
            raise UnreachableTarget(f"epsilon={epsilon} at delta={delta} is unreachable with sample rate "
                                    f"{sample_rate:.4g} over {steps} steps, even with noise multiplier {MAX_SIGMA:g}")
    if lo == hi:
        while lo > MIN_SIGMA and eps(lo) <= epsilon:
            hi, lo = lo, lo / 2
        lo = min(lo, hi / 2)
    sigma = dp_accounting.calibrate_dp_mechanism(
        lambda: _accountant(accountant, neighbouring),
        lambda s: _event(s, sample_rate, steps, sampling, dataset_size),
        epsilon, delta,
        bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi),
        discrete=False, tol=tolerance)
    return float(sigma)
