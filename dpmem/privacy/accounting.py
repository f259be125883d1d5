"""Privacy accounting by dp-accounting: epsilon spent for a noise multiplier, and the noise multiplier for a
target epsilon. One DP event per logical step: a sampled Gaussian mechanism with noise multiplier sigma; with
accountant "rc" its sensitivity is random (DP-SGD-RC's randomized clipping, dpmem.privacy.rc_envelope).

`loss_noise` (c): each step also releases the batch's training loss, Σᵢ min(max(ℓᵢ, 0), L) + N(0, (c·σ·L)²), on the
same sampled batch. The pair is one Gaussian mechanism on that batch: a record moves the gradient's sum by at most
C (noise σC) and the loss sum by at most L (noise cσL), so in units of their noise by √(1/σ² + 1/(cσ)²), which is
a Gaussian of multiplier σ/√(1 + 1/c²) (`joint_sigma`) and sensitivity 1. Under replace-one the loss moves by at
most L where the gradient's sum moves by 2C: accounting it as 2L too is conservative."""

from __future__ import annotations

import functools
import math
import numbers

import dp_accounting
from absl import logging as absl_logging
from dp_accounting import dp_event, pld, rdp
from scipy import optimize
from scipy.stats import binom

from dpmem.privacy import rc_envelope as rc

NeighborRel = dp_accounting.NeighboringRelation
RELATIONS = {"add_remove": NeighborRel.ADD_OR_REMOVE_ONE, "replace_one": NeighborRel.REPLACE_ONE}
ACCOUNTANTS = ("pld", "rdp", "rc")
SAMPLINGS = ("poisson", "fixed", "cyclic")
# PLD discretisation: 1e-3 keeps a 1000-step composition under a second and errs on the pessimistic side.
PLD_DISCRETIZATION = 1e-3
# calibrate_sigma searches on a grid this much coarser first, where dpmem builds the PLD itself, and then checks
# the fine grid's root from it: a mixture's PLD is built by root-finding per bucket (4 s at σ 0.65 on the fine grid,
# 0.5 s on this one), and a Poisson Gaussian's took 0.05-0.1 s a σ, seven σ a calibration
SEARCH_COARSENING = 10
MIN_SIGMA, MAX_SIGMA = 0.05, 1e3
# Randomized clipping with few probes has a heavy-tailed sensitivity (k = 1, 2 need noise multipliers in the
# hundreds to hundreds of thousands), so rc searches further before refusing a target.
RC_MAX_SIGMA = 1e7
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


def _event(sigma: float, sample_rate: float, steps: int, sampling: str, dataset_size: int | None,
           groups: int | None = None, noise: tuple | None = None, user_records: int | None = None):
    """The DP event of `steps` steps of noise multiplier `sigma` (the joint one, `joint_sigma`). Cyclic sampling
    (correlated noise, `dpmem.privacy.strategies`): a banded strategy of at most `groups` bands is ceil(steps/G)
    compositions of a Poisson-subsampled Gaussian at the group's rate (Choquette-Choo et al. 2023, jax-privacy's
    `amplified_bandmf_event`); bisr's C is not banded, so no amplification is claimed: one Gaussian of its sensitivity
    over the steps' participations, G apart (`cyclic_sensitivity`). `user_records` (ELS, privacy.unit=user with
    user_sampling=records): a user's k records each join a step at rate q, and each moves the clipped sum by at most
    C, so a step is a mixture of Gaussians of sensitivity j with probability Binomial(k, q)(j) (Charles et al. 2024,
    dp-accounting's MixtureOfGaussiansDpEvent; PLD only)."""
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    if user_records is not None:
        if sampling != "poisson":
            raise ValueError(f"user-level accounting of records (ELS) is for poisson sampling, not {sampling}")
        k = int(user_records)
        mixture = dp_event.MixtureOfGaussiansDpEvent(sigma, list(range(k + 1)),
                                                          [float(p) for p in binom.pmf(range(k + 1), k, sample_rate)])
        return dp_accounting.SelfComposedDpEvent(mixture, steps)
    if sampling == "cyclic":
        if not groups or dataset_size is None:
            raise ValueError("cyclic sampling needs groups and dataset_size")
        if noise is not None and noise[0] == "bisr":
            return dp_accounting.GaussianDpEvent(sigma / cyclic_sensitivity(noise, steps, groups))
        rate = group_rate(sample_rate, dataset_size, groups)
        return dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(rate, gaussian),
                                                 math.ceil(steps / groups))
    if sampling == "poisson":
        step = dp_accounting.PoissonSampledDpEvent(sample_rate, gaussian)
    elif sampling == "fixed":
        if dataset_size is None:
            raise ValueError("fixed-size sampling needs dataset_size")
        step = dp_accounting.SampledWithoutReplacementDpEvent(dataset_size, round(sample_rate * dataset_size), gaussian)
    else:
        raise ValueError(f"sampling {sampling!r}: allowed {', '.join(SAMPLINGS)}")
    return dp_accounting.SelfComposedDpEvent(step, steps)


@functools.lru_cache(maxsize=32)
def _mixture_step(sigma: float, sample_rate: float, k: int, interval: float = PLD_DISCRETIZATION):
    """ELS's one step (`_event`) as a privacy loss distribution, as PLDAccountant builds it: built by root-finding
    per bucket, seconds at small σ, so kept for the run's later ε (the same σ at every logged step)."""
    return pld.privacy_loss_distribution.from_mixture_gaussian_mechanism(
        sigma, list(range(k + 1)), [float(p) for p in binom.pmf(range(k + 1), k, sample_rate)],
        value_discretization_interval=interval)


def _mixture_epsilon(sigma: float, delta: float, sample_rate: float, steps: int, k: int,
                     interval: float = PLD_DISCRETIZATION) -> float:
    return float(_mixture_step(sigma, sample_rate, k, interval).self_compose(steps).get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=32)
def _poisson_step(sigma: float, sample_rate: float, neighbouring: str, interval: float = PLD_DISCRETIZATION):
    """One Poisson-subsampled Gaussian step as a privacy loss distribution, built as PLDAccountant builds it: most of
    a PLD's ε is this construction (0.15 s at σ ~ 1), so a run's ε at each logged step, of one σ, builds it once."""
    return pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=interval, sampling_prob=sample_rate,
        neighboring_relation=RELATIONS[neighbouring])


def _poisson_epsilon(sigma: float, delta: float, sample_rate: float, steps: int, neighbouring: str,
                     interval: float = PLD_DISCRETIZATION) -> float:
    """What PLDAccountant composes for SelfComposed(PoissonSampled(Gaussian)), its one step kept."""
    composed = _poisson_step(sigma, sample_rate, neighbouring, interval).self_compose(steps)
    return float(pld.privacy_loss_distribution.identity(interval).compose(composed).get_epsilon_for_delta(delta))


def _own_pld(delta: float, sample_rate: float, steps: int, accountant: str, neighbouring: str, sampling: str,
             dataset_size: int | None, groups: int | None, noise, user_records: int | None, interval: float):
    """ε(σ of the joint Gaussian) on the grid `interval`, for the events whose PLD dpmem builds itself (ELS's
    mixture, a Poisson or a banded cyclic Gaussian); None for the others (dp-accounting's accountants compose them)."""
    if user_records is not None and accountant == "pld" and neighbouring == "add_remove" and sampling == "poisson":
        return lambda s: _mixture_epsilon(s, delta, sample_rate, steps, int(user_records), interval=interval)
    banded = sampling == "cyclic" and groups and dataset_size is not None and not (noise and noise[0] == "bisr")
    if accountant == "pld" and user_records is None and neighbouring in RELATIONS and (sampling == "poisson" or banded):
        # a banded strategy's at its group's rate, once a participation
        rate, count = ((group_rate(sample_rate, dataset_size, groups), math.ceil(steps / groups)) if banded
                       else (sample_rate, steps))
        return lambda s: _poisson_epsilon(s, delta, rate, count, neighbouring, interval=interval)
    return None


def group_rate(sample_rate: float, dataset_size: int, groups: int) -> float:
    """Cyclic sampling's rate within a group: the batch size over the smallest group's size, B / floor(n/G) (as
    jax-privacy's DpsgdTrainingAccountant takes it), which a step samples its group's records at."""
    return round(sample_rate * dataset_size) / (dataset_size // groups)


def cyclic_sensitivity(noise: tuple, steps: int, groups: int) -> float:
    """The sensitivity, in units of the per-participation multiplier, of a record's releases over `steps` steps of
    strategy `noise` ((name, bands, horizon)) with participations `groups` apart: √max(s², k), s the strategy's
    min-separation sensitivity, k = ceil(steps/G) participations. max(s², k) bounds the gradient's s²/σ² and the
    loss's k/(cσ)² together in units of the joint multiplier 1/σ_j² = 1/σ² + 1/(cσ)² (s² alone where s² ≥ k, as
    bisr's is)."""
    from dpmem.privacy.strategies import make_strategy
    k = math.ceil(steps / groups)
    return math.sqrt(max(make_strategy(*noise).sensitivity(steps, groups) ** 2, k))


def _tuple(noise) -> tuple | None:
    """A strategy as a tuple (a ledger's JSON gives a list)."""
    return None if noise is None else tuple(noise)


def joint_sigma(sigma: float, loss_noise: float | None) -> float:
    """The noise multiplier of one Gaussian equivalent to the step's gradient and loss releases together."""
    return sigma if loss_noise is None else sigma / math.sqrt(1 + loss_noise ** -2)


def _numbers(**values) -> None:
    """A string, None or bool where a number belongs (calibrate_sigma('8', ...)) refused by its name, not left to
    fail a comparison; steps must be whole."""
    for name, value in values.items():
        kind = numbers.Integral if name == "steps" else numbers.Real
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TypeError(f"{name}={value!r} ({type(value).__name__}): allowed "
                            f"{'an integer' if kind is numbers.Integral else 'a number'}")


def _check(delta: float, sample_rate: float, steps: int) -> None:
    _numbers(delta=delta, sample_rate=sample_rate, steps=steps)
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta} must be in (0, 1)")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate={sample_rate} must be in (0, 1]")
    if steps < 0:
        raise ValueError(f"steps={steps} must be >= 0")


def _check_terms(accountant: str, sampling: str, groups, noise, user_records) -> None:
    """The keywords of one kind of run refused where another kind's are given, rather than ignored (noise= under
    Poisson sampling would account independent noise) or misread (noise='bandmf', a string, read as a tuple)."""
    if sampling != "cyclic" and (groups is not None or noise is not None):
        given = "groups" if groups is not None else "noise"
        raise ValueError(f"{given}={groups if groups is not None else noise!r}: groups and noise are cyclic "
                         f"sampling's (correlated noise, sampling='cyclic'); {sampling} sampling has neither")
    if noise is not None and not (isinstance(noise, (tuple, list)) and len(noise) == 3
                                  and noise[0] in ("bandmf", "bisr")
                                  and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1
                                          for x in noise[1:])):
        raise ValueError(f"noise={noise!r}: allowed (name, bands, horizon) with name bandmf or bisr and positive "
                         "integers, e.g. ('bandmf', 4, 100), or None for independent noise")
    if user_records is not None:
        if not isinstance(user_records, numbers.Integral) or isinstance(user_records, bool) or user_records < 1:
            raise ValueError(f"user_records={user_records!r} must be a positive integer (ELS's k: the most records "
                             "of one user the run uses)")
        if accountant == "rc":
            raise ValueError("user_records: the rc accountant bounds one record's random sensitivity, not a user's; "
                             "allowed with user_records: pld")


def epsilon_spent(sigma: float, delta: float, sample_rate: float, steps: int, accountant: str = "pld",
                  neighbouring: str = "add_remove", sampling: str = "poisson",
                  dataset_size: int | None = None, k: int = 32, d: float | None = None,
                  estimator: str = "hutch", loss_noise: float | None = None, groups: int | None = None,
                  noise: tuple | None = None, user_records: int | None = None) -> float:
    """Epsilon after `steps` sampled Gaussian steps with noise multiplier `sigma` (inf if sigma is 0), each with
    the batch's noised loss when `loss_noise` is given (see the module's docstring).

    Args:
        sigma: the noise multiplier (std σ·C on the clipped sum).
        delta: δ.
        sample_rate: q, the rate at which a record joins a step.
        steps: logical steps taken.
        accountant: `pld`, `rdp` or `rc` (DP-SGD-RC's randomized clipping).
        neighbouring: `add_remove` or `replace_one`.
        sampling: `poisson`, or `fixed` (sampling without replacement; rdp and `replace_one` only).
        dataset_size: n, for fixed-size sampling.
        k: rc only: probes.
        d: rc only: the envelope's dimension (a positive integer, e.g. the DP-SGD-RC paper's max-min layer size,
            or math.inf; see dpmem.methods.rc.rc_dimension).
        estimator: rc only: "hutch" or "hutchpp".
        loss_noise: c, where the training loss is released privately with noise c·σ·L.
        groups: cyclic sampling's G (correlated noise).
        noise: the correlated strategy (name, bands, horizon) under cyclic sampling; None: independent noise.
        user_records: ELS's k: ε of a user of at most k records, each sampled at `sample_rate` (`_event`).

    Returns:
        ε at `delta`.
    """
    _numbers(sigma=sigma)
    _check(delta, sample_rate, steps)
    _check_terms(accountant, sampling, groups, noise, user_records)
    if accountant == "rc":
        if neighbouring != "add_remove":
            raise ValueError(f"accountant rc: neighbouring {neighbouring!r} is not supported, allowed add_remove")
        if sampling != "poisson":
            raise ValueError(f"accountant rc: sampling {sampling!r} is not supported, allowed poisson")
        rc.check_args(k, d, estimator)
    if steps == 0:
        return 0.0
    if sigma <= 0:
        return math.inf
    if accountant == "rc":
        return rc.rc_epsilon(sigma, delta, sample_rate, steps, k, d, estimator, PLD_DISCRETIZATION, loss_noise)
    own = _own_pld(delta, sample_rate, steps, accountant, neighbouring, sampling, dataset_size, groups, noise,
                   user_records, PLD_DISCRETIZATION)
    if own is not None:  # what PLDAccountant composes for `_event`, its one step kept: a run asks at each logged step
        return own(joint_sigma(sigma, loss_noise))
    acc = _accountant(accountant, neighbouring)
    event = _event(joint_sigma(sigma, loss_noise), sample_rate, steps, sampling, dataset_size, groups,
                   _tuple(noise), user_records)
    if not acc.supports(event):
        raise ValueError(f"accountant {accountant} does not support {sampling} sampling under {neighbouring}")
    return float(acc.compose(event).get_epsilon(delta))


def composed_epsilon(runs: list[dict], delta: float, accountant: str = "pld",
                     neighbouring: str = "add_remove") -> float:
    """Epsilon of releasing what several runs on the same data produced (a search's chosen result): their
    mechanisms composed. Each run is {sigma, sample_rate, steps, sampling, dataset_size}; inf if any added no
    noise."""
    events = []
    for r in runs:
        _check(delta, r["sample_rate"], r["steps"])
        if r["steps"] == 0:
            continue
        if r["sigma"] <= 0:
            return math.inf
        events.append(_event(r["sigma"], r["sample_rate"], r["steps"], r["sampling"], r.get("dataset_size"),
                             r.get("groups"), _tuple(r.get("noise")), r.get("user_records")))
    if not events:
        return 0.0
    acc = _accountant(accountant, neighbouring)
    event = dp_accounting.ComposedDpEvent(events)
    if not acc.supports(event):
        raise ValueError(f"accountant {accountant} does not support these runs' sampling under {neighbouring}")
    return float(acc.compose(event).get_epsilon(delta))


def _bracket(eps, epsilon: float, max_sigma: float, unreachable: str) -> tuple[float, float]:
    """Noise multipliers lo < hi with eps(lo) > epsilon >= eps(hi), by doubling/halving from 1. Below MIN_SIGMA a
    PLD needs ~1/sigma^2 buckets (memory) and no DP training runs there; above max_sigma the target is refused."""
    lo, hi = 1.0, 1.0
    while eps(hi) > epsilon:
        lo, hi = hi, hi * 2
        if hi > max_sigma:
            raise UnreachableTarget(f"{unreachable}, even with noise multiplier {max_sigma:g}")
    if lo == hi:
        while lo > MIN_SIGMA and eps(lo) <= epsilon:
            hi, lo = lo, lo / 2
        if eps(lo) <= epsilon:
            raise UnreachableTarget(f"{epsilon:g} is looser than the epsilon of the least noise dpmem adds "
                                    f"(multiplier {lo:g}: {eps(lo):.4g}); a budget that large protects nothing: "
                                    "give a smaller epsilon, or privacy=none for a non-private run")
        lo = min(lo, hi / 2)
    return lo, hi


def _below(eps, epsilon: float, sigma: float, tolerance: float, slope: float) -> tuple[float, float] | None:
    """A bracket (lo, hi) of `_bracket`'s kind at or below `sigma`, where eps(sigma) <= epsilon is expected (a root
    on a grid that overstates ε), and `slope` is dε/dσ there on that grid: first Newton's guess of the root from
    `sigma` (the two grids' curves nearly parallel), then (sigma - tolerance, sigma) where that holds the root, else
    one found by doubling the step down; None where eps(sigma) > epsilon (then the search starts afresh)."""
    if eps(sigma) > epsilon:
        return None
    guess = sigma - (epsilon - eps(sigma)) / -slope + tolerance / 2  # half a tolerance above the guessed root
    if slope < 0 and MIN_SIGMA + tolerance < guess < sigma - tolerance:
        if eps(guess) > epsilon:
            return guess, sigma
        sigma = guess
    step = tolerance
    while sigma - step > MIN_SIGMA and eps(sigma - step) <= epsilon:
        sigma, step = sigma - step, 2 * step
    return (sigma - step, sigma) if sigma - step > MIN_SIGMA else None


def _root(eps, epsilon: float, lo: float, hi: float, tolerance: float) -> float:
    """dp_accounting.calibrate_dp_mechanism's search over the bracket (lo, hi) of `_bracket`: Brent's root of
    eps(σ) - epsilon to `tolerance`, then the multiplier of no more than `epsilon` (the root, or the root + tolerance,
    or else bisection's upper end). `eps` remembers its values (calibrate_sigma's): the bracket's ends, which
    `_bracket` computed, and the root are not built again, where calibrate_dp_mechanism builds each anew (a PLD of
    ELS's mixture takes seconds)."""
    def gap(s: float) -> float:
        return eps(s) - epsilon

    root = float(optimize.brentq(gap, lo, hi, xtol=tolerance))
    if gap(root) <= 0:
        return root
    if gap(root + tolerance) <= 0:
        return root + tolerance
    while hi - lo > tolerance:  # the bisection dp-accounting falls back to: its upper end never spends more
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if gap(mid) <= 0 else (mid, hi)
    return hi


@functools.lru_cache(maxsize=256)  # a sweep over seeds or learning rates calibrates the same sigma once per process
def calibrate_sigma(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "pld",
                    neighbouring: str = "add_remove", sampling: str = "poisson",
                    dataset_size: int | None = None, tolerance: float = 1e-3, k: int = 32, d: float | None = None,
                    estimator: str = "hutch", loss_noise: float | None = None, groups: int | None = None,
                    noise: tuple | None = None, user_records: int | None = None) -> float:
    """The smallest noise multiplier of the gradient whose epsilon after `steps` steps (with the loss releases of
    `loss_noise`) is at most `epsilon`.

    Args:
        epsilon: the target ε.
        delta: δ.
        sample_rate: q, the rate at which a record joins a step.
        steps: logical steps the run will take.
        accountant: `pld`, `rdp` or `rc`; the others as in `epsilon_spent`.
        tolerance: how close to `epsilon` (for rc relative above σ = 1).

    Returns:
        σ, the noise multiplier.

    Raises:
        TypeError: an argument that is not a number (steps: an integer).
        ValueError: a bad argument, or (as `UnreachableTarget`) an ε no noise reaches.
    """
    _numbers(epsilon=epsilon)
    _check(delta, sample_rate, steps)
    _check_terms(accountant, sampling, groups, noise, user_records)
    if not epsilon > 0:
        raise ValueError(f"epsilon={epsilon} must be > 0")
    if steps <= 0:
        raise ValueError(f"steps={steps} must be positive")

    @functools.cache  # `_bracket` and `_root` ask for some σ twice
    def eps(s: float) -> float:  # rc's of the gradient's multiplier, the others' of the joint one
        return epsilon_spent(s, delta, sample_rate, steps, accountant, neighbouring, sampling, dataset_size, k, d,
                             estimator, loss_noise if accountant == "rc" else None, groups, noise, user_records)

    if accountant == "rc":
        # bisection: rc has no dp-accounting event, and its epsilon is inf (not a number to interpolate) while the
        # +inf loss mass of the lower envelope tail exceeds delta
        lo, hi = _bracket(eps, epsilon, RC_MAX_SIGMA, f"epsilon={epsilon} at delta={delta} is unreachable by "
                          f"DP-SGD-RC (k={k}, d={d}, {estimator}) over {steps} steps")
        while hi - lo > tolerance * max(1.0, lo):  # relative above 1: k = 1 needs sigma ~ 1e5
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if eps(mid) <= epsilon else (mid, hi)
        return hi
    # a budget looser than the least noise's ε is refused by RDP's bound at once (RDP is above PLD's ε, and PLD at
    # σ = MIN_SIGMA needs a minute of buckets): what `_bracket` would conclude after halving down to MIN_SIGMA
    try:
        least = epsilon_spent(MIN_SIGMA, delta, sample_rate, steps, "rdp", neighbouring, sampling, dataset_size,
                              groups=groups, noise=noise, user_records=user_records)
    except ValueError:  # an event RDP does not support (Poisson under replace-one): `_bracket` alone decides
        least = math.inf
    if epsilon >= least:
        raise UnreachableTarget(f"{epsilon:g} is looser than the epsilon of the least noise dpmem adds (multiplier "
                                f"{MIN_SIGMA:g}: {least:.4g} or less); a budget that large protects nothing: give a "
                                "smaller epsilon, or privacy=none for a non-private run")
    unreachable = (f"epsilon={epsilon} at delta={delta} is unreachable with sample rate {sample_rate:.4g} over "
                   f"{steps} steps")
    bracket = None
    coarse = _own_pld(delta, sample_rate, steps, accountant, neighbouring, sampling, dataset_size, groups, noise,
                      user_records, PLD_DISCRETIZATION * SEARCH_COARSENING)
    if coarse is not None:
        # the search on a coarser grid first, whose buckets round each privacy loss up to a multiple of the fine
        # grid's, so that its ε is above the fine one's and its root above the fine root; the fine grid's root is
        # then bracketed from it (`_below`: a Newton step on the coarse grid's slope), by two to six fine PLDs
        # where a search on the fine grid alone built seven to seventeen
        coarse = functools.cache(coarse)
        try:
            root = _root(coarse, epsilon, *_bracket(coarse, epsilon, MAX_SIGMA, unreachable), tolerance)
            slope = (coarse(root) - coarse(root - tolerance)) / tolerance
            bracket = _below(eps, epsilon, root, tolerance, slope)
        except UnreachableTarget:  # the coarse grid's ε at MAX_SIGMA, above the fine one's: the fine grid decides
            bracket = None
        if bracket and bracket[1] - bracket[0] <= tolerance:  # the fine root within tolerance below the coarse one
            return bracket[1] / joint_sigma(1.0, loss_noise)
    lo, hi = bracket or _bracket(eps, epsilon, MAX_SIGMA, unreachable)
    return _root(eps, epsilon, lo, hi, tolerance) / joint_sigma(1.0, loss_noise)  # the gradient's, of the joint one
