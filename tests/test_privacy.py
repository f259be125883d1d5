"""Accounting against dp-accounting called directly, Opacus' get_noise_multiplier, and a closed form."""

import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp
from opacus.accountants.utils import get_noise_multiplier
from scipy.optimize import brentq
from scipy.stats import norm

from dpmem.config import resolve_delta
from dpmem.privacy import UnreachableTarget, calibrate_sigma, epsilon_spent
from dpmem.privacy.accounting import PLD_DISCRETIZATION

Q, STEPS, DELTA = 128 / 1437, 449, 1 / 1437


def direct_epsilon(accountant, sigma, q, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    acc = (pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION) if accountant == "pld"
           else rdp.RdpAccountant())
    return acc.compose(event).get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_epsilon_spent_equals_dp_accounting(accountant):
    for sigma, steps in [(1.0, 100), (0.8, 449)]:
        assert epsilon_spent(sigma, DELTA, Q, steps, accountant) == pytest.approx(
            direct_epsilon(accountant, sigma, Q, steps, DELTA), rel=1e-12)


@pytest.mark.parametrize("accountant,opacus_name", [("pld", "prv"), ("rdp", "rdp")])
@pytest.mark.parametrize("epsilon", [2.0, 8.0])
def test_calibrate_sigma_matches_opacus(accountant, opacus_name, epsilon):
    ours = calibrate_sigma(epsilon, DELTA, Q, STEPS, accountant)
    theirs = get_noise_multiplier(target_epsilon=epsilon, target_delta=DELTA, sample_rate=Q, steps=STEPS,
                                  accountant=opacus_name, epsilon_tolerance=0.005)
    # PLD vs PRV are two numerical methods for the same quantity; RDP orders differ slightly between libraries
    assert ours == pytest.approx(theirs, rel=0.01)
    # and the calibrated sigma really spends (just about) the target
    spent = epsilon_spent(ours, DELTA, Q, STEPS, accountant)
    assert epsilon * 0.99 <= spent <= epsilon * 1.0005


@pytest.mark.parametrize("neighbouring, understated", [
    ("add_remove", 0), ("replace_one", 0),
    ("add_remove", 0.05),  # a search grid that understates ε (its root below): the search on the fine grid
])
def test_calibrate_sigma_is_dp_accountings_calibration_on_its_grid(monkeypatch, neighbouring, understated):
    """calibrate_sigma searches a Poisson Gaussian on a coarser grid first and brackets the fine root from it: the σ
    is dp-accounting's own calibration on dpmem's grid, to the tolerance, and spends no more than the target."""
    from dpmem.privacy import accounting
    fine, real = accounting.PLD_DISCRETIZATION, accounting._poisson_epsilon
    monkeypatch.setattr(accounting, "_poisson_epsilon", lambda *a, interval=fine: real(
        *a, interval=interval) - (understated if interval != fine else 0))
    accounting.sigma_for.cache_clear()
    target, q, steps, tolerance = 2.0, 0.05, 30, 1e-3
    sigma = accounting.calibrate_sigma(target, DELTA, q, steps, neighbouring=neighbouring)
    accounting.sigma_for.cache_clear()
    relation = accounting.RELATIONS[neighbouring]
    want = dp_accounting.calibrate_dp_mechanism(
        lambda: pld.PLDAccountant(relation, value_discretization_interval=PLD_DISCRETIZATION),
        lambda s: dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), steps),
        target, DELTA, dp_accounting.ExplicitBracketInterval(sigma - 0.01, sigma + 0.01), tol=tolerance)
    assert epsilon_spent(sigma, DELTA, q, steps, neighbouring=neighbouring) <= target
    assert abs(sigma - want) <= tolerance + 1e-9, (sigma, want)


def analytic_gaussian_delta(eps, sigma, sensitivity):
    """Balle & Wang (2018), Theorem 8: the exact delta(eps) of the Gaussian mechanism."""
    a = sensitivity / (2 * sigma)
    b = eps * sigma / sensitivity
    return norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b)


@pytest.mark.parametrize("neighbouring,sensitivity", [("add_remove", 1.0), ("replace_one", 2.0)])
def test_single_gaussian_matches_closed_form(neighbouring, sensitivity):
    """No subsampling, one step: replace-one moves one clipped contribution from +C to -C (sensitivity 2C)."""
    sigma, delta = 2.0, 1e-5
    exact = brentq(lambda e: analytic_gaussian_delta(e, sigma, sensitivity) - delta, 1e-6, 50)
    got = epsilon_spent(sigma, delta, 1.0, 1, "pld", neighbouring)
    assert got == pytest.approx(exact, abs=2e-3)  # PLD is pessimistic by at most its discretisation
    assert got >= exact - 1e-9


def test_fixed_size_sampling_uses_sampled_without_replacement():
    n, batch = 1000, 100
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(n, batch, dp_accounting.GaussianDpEvent(1.0)), 50)
    want = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE) \
        .compose(event).get_epsilon(1e-5)
    got = epsilon_spent(1.0, 1e-5, batch / n, 50, "rdp", "replace_one", "fixed", dataset_size=n)
    assert got == pytest.approx(want, rel=1e-12)


def test_unsupported_combination_is_refused():
    with pytest.raises(ValueError, match="does not support"):
        epsilon_spent(1.0, 1e-5, 0.1, 10, "rdp", "replace_one", "poisson")


def test_unreachable_target_is_refused_before_training():
    # with q = 1 the first step alone leaks: eps = 0.01 at delta 1e-5 needs a noise multiplier over 1000
    with pytest.raises(UnreachableTarget, match="unreachable"):
        calibrate_sigma(0.001, 1e-5, 1.0, 10000)


def test_more_steps_spend_more():
    a, b = (epsilon_spent(1.0, 1e-5, 0.01, s) for s in (100, 1000))
    assert 0 < a < b
    assert epsilon_spent(0.0, 1e-5, 0.01, 10) == math.inf
    assert epsilon_spent(1.0, 1e-5, 0.01, 0) == 0.0


def test_replace_one_calibrates_twice_the_noise_without_subsampling():
    """Replace-one moves one clipped contribution from +C to -C: without subsampling, exactly twice the noise of
    add/remove. This is how dpmem applies the relation for every method (DPZero's code writes 2C/B by hand)."""
    add = calibrate_sigma(1.0, 1e-5, 1.0, 1, "pld", "add_remove", tolerance=1e-5)
    replace = calibrate_sigma(1.0, 1e-5, 1.0, 1, "pld", "replace_one", tolerance=1e-5)
    assert replace / add == pytest.approx(2.0, rel=2e-3)


@pytest.mark.parametrize("n", [2, 1437, 60_000, 10**6, 10**9])
def test_the_default_delta_is_below_one_over_n(n):
    delta = resolve_delta("auto", n)
    assert delta * n < 1 and delta <= 1e-5 and delta <= n ** -1.1
    assert delta == pytest.approx(min(1e-5, n ** -1.1))  # the smaller of the two rules, each reached
    assert resolve_delta("1/n", n) == pytest.approx(1 / n) and resolve_delta("3e-7", n) == 3e-7
