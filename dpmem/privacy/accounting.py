"""Privacy accounting by dp-accounting: a run's privacy event as one frozen value (`Event`: σ, δ, q and the
analysis's terms), its epsilon after t steps (`epsilon_of`), the noise multiplier for a target epsilon (`sigma_for`),
and several events composed (`composed_epsilon`); `epsilon_spent` and `calibrate_sigma` are their keyword form. One
DP event per logical step: a sampled Gaussian mechanism with noise multiplier sigma; with accountant "rc" its
sensitivity is random (DP-SGD-RC's randomized clipping, dpmem.privacy.rc_envelope).

`loss_noise` (c): each step also releases the batch's training loss, Σᵢ min(max(ℓᵢ, 0), L) + N(0, (c·σ·L)²), on the
same sampled batch. The pair is one Gaussian mechanism on that batch: a record moves the gradient's sum by at most
C (noise σC) and the loss sum by at most L (noise cσL), so in units of their noise by √(1/σ² + 1/(cσ)²), which is
a Gaussian of multiplier σ/√(1 + 1/c²) (`joint_sigma`) and sensitivity 1. Under replace-one the loss moves by at
most L where the gradient's sum moves by 2C: accounting it as 2L too is conservative."""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class Event:
    """A run's privacy event: what its ε is computed from (`dpmem.privacy.accounting`): the noise multiplier, δ, the
    rate a step samples at, and the analysis's terms (accountant, neighbouring relation, sampling, the data's size,
    the loss's noise released with the gradient, cyclic groups and the correlated strategy, ELS's k, randomized
    clipping's envelope). Frozen: a run's ε at t steps is `epsilon(t)`."""
    sigma: float
    delta: float | None  # None: nothing accounted (privacy=none; a plan)
    sample_rate: float
    accountant: str = "pld"
    neighbouring: str = "add_remove"
    sampling: str = "poisson"
    dataset_size: int | None = None
    loss_noise: float | None = None
    groups: int | None = None
    noise: tuple | None = None  # the correlated strategy (name, bands, horizon); None: independent noise
    user_records: int | None = None
    rc: tuple | None = None  # randomized clipping's (k, d, estimator)

    @classmethod
    def of(cls, sigma: float, delta: float, sample_rate: float, terms: dict) -> Event:
        """From epsilon_spent's keywords after (σ, δ, q, steps); rc's envelope where they hold its k (and are rc's),
        a strategy given as a list (a ledger's JSON) as a tuple."""
        rc = (terms["k"], terms["d"], terms["estimator"]) if terms.get("accountant") == "rc" and "k" in terms else None
        kept = {k: v for k, v in terms.items() if k not in ("k", "d", "estimator")}
        if isinstance(kept.get("noise"), list):
            kept["noise"] = tuple(kept["noise"])
        return cls(sigma, delta, sample_rate, **kept, rc=rc)

    @property
    def joint_sigma(self) -> float:
        """The multiplier of the one Gaussian that the step's gradient and loss releases make together."""
        return joint_sigma(self.sigma, self.loss_noise)

    def epsilon(self, steps: int) -> float:
        """ε after `steps` steps (`epsilon_of`)."""
        return epsilon_of(self, steps)

    def calibrated(self, epsilon: float, steps: int, tolerance: float = 1e-3) -> Event:
        """This event at the least σ whose ε after `steps` steps is at most `epsilon` (`sigma_for`; its own σ is
        not read, and is 0 in the calibration's cache key)."""
        return replace(self, sigma=sigma_for(replace(self, sigma=0.0), epsilon, steps, tolerance))

    def as_accounted(self) -> Event:
        """The event as a ledger line accounts it (`line`, `from_line`): the gradient's and the loss's releases as one
        Gaussian of the joint multiplier, no loss noise beside it; rc's as it is (its envelope composes the loss)."""
        return self if self.rc else replace(self, sigma=self.joint_sigma, loss_noise=None)

    def costlier(self, other: Event, steps: int) -> tuple[Event, float]:
        """Of this event and `other`, the one that spends more ε over `steps` steps, and its ε: where two records of
        one run disagree (its ledger and its config.yaml), the report composes the one that spends more. This one
        where they tie, or where `other` cannot be accounted (a field of the wrong kind)."""
        mine = self.epsilon(steps)
        if other == self:
            return self, mine
        try:
            theirs = other.epsilon(steps)
        except (TypeError, ValueError):
            return self, mine
        return (other, theirs) if theirs > mine else (self, mine)

    def line(self) -> dict:
        """What a privacy.jsonl line records of the event (beside its ε and steps), for `from_line` to read back: σ
        accounted per step (the gradient's and the loss's releases as one multiplier; None for rc, whose envelope
        the line does not hold), and the analysis's terms; accountant, relation and σ None where nothing is
        accounted."""
        accounted = self.delta is not None
        return {"delta": self.delta,
                "sigma_accounted": self.joint_sigma if accounted and not self.rc else None,
                "sample_rate": self.sample_rate, "accountant": self.accountant if accounted else None,
                "neighbouring": self.neighbouring if accounted else None, "sampling": self.sampling,
                "dataset_size": self.dataset_size, "groups": self.groups, "strategy": self.noise,
                "user_records": self.user_records}

    @classmethod
    def from_line(cls, line: dict) -> Event:
        """The event a privacy.jsonl line (`line`), or a record named as one, says its ε was computed from: the
        joint σ (its `sigma` where it has no `sigma_accounted`: an older line), with no loss noise beside it.
        Raises KeyError, TypeError or ValueError where a field it needs is missing or not a number."""
        strategy = line.get("strategy")
        return cls(float(line.get("sigma_accounted") or line["sigma"]), float(line["delta"]),
                   float(line["sample_rate"]), line["accountant"], line.get("neighbouring") or "add_remove",
                   line.get("sampling") or "poisson", line.get("dataset_size"), groups=line.get("groups"),
                   noise=None if strategy is None else tuple(strategy), user_records=line.get("user_records"))

    @classmethod
    def from_lines(cls, lines: list[dict], fallback: dict) -> Event:
        """The event an attempt's privacy.jsonl lines say it ran, the later line's field over the earlier's, and
        how it sampled and correlated its noise from `fallback` (its summary's, `record.summary_line`) where an
        older ledger's lines do not say; as written, nothing required (`from_line` requires what ε needs)."""
        known = {k: fallback[k] for k in ("sampling", "dataset_size", "neighbouring", "groups", "strategy",
                                          "user_records") if k in fallback}
        for line in lines:
            known.update((k, v) for k, v in line.items() if v is not None)
        strategy = known.get("strategy")
        return cls(float(known.get("sigma_accounted", known.get("sigma", 0.0))), known.get("delta"),
                   known.get("sample_rate"), known.get("accountant"), known.get("neighbouring", "add_remove"),
                   known.get("sampling", "poisson"), known.get("dataset_size"), groups=known.get("groups"),
                   noise=tuple(strategy) if isinstance(strategy, list) else strategy,
                   user_records=known.get("user_records"))

    def sampled_as(self, other: Event) -> Event:
        """This event, sampled and its noise correlated as `other` says (sampling, groups, strategy, ELS's k)."""
        return replace(self, sampling=other.sampling, groups=other.groups, noise=other.noise,
                       user_records=other.user_records)

    def sampling_text(self) -> str:
        """How the event samples and correlates its noise, in words: "poisson", "cyclic (bandmf, 4 bands, 4
        groups)", "poisson, a user's 4 records (ELS)"."""
        noise, k = self.noise, self.user_records
        return (str(self.sampling) + (f" ({noise[0]}, {noise[1]} bands, {self.groups} groups)" if noise else "")
                + (f", a user's {k} records (ELS)" if k else ""))

    def analysis(self, uls: bool = False) -> str:
        """What ε is computed as, in words: the summary's, the ledger's and the report's name for the event (`uls`:
        the units sampled are users)."""
        if self.accountant == "rc":
            return "randomized clipping's envelope under Poisson sampling (rc)"
        if self.user_records:
            return (f"a user of at most {self.user_records} records (ELS): a mixture of Gaussians of sensitivity "
                    "j ~ Binomial(k, q) per step, composed over the steps")
        if self.noise is None:
            return f"{self.sampling}-subsampled Gaussian{' of users (ULS)' if uls else ''}, composed over the steps"
        if self.noise[0] == "bisr":
            return (f"one Gaussian of bisr's sensitivity over participations {self.groups} steps apart (cyclic "
                    "groups), no amplification")
        return (f"amplified bandmf: ceil(steps / {self.groups}) compositions of a Poisson-subsampled Gaussian at the "
                "group's rate (cyclic groups)")


def joint_sigma(sigma: float, loss_noise: float | None) -> float:
    """The noise multiplier of one Gaussian equivalent to a step's gradient release (multiplier `sigma`) and its loss
    release (multiplier `loss_noise`·σ) together (`dpmem.privacy.accounting`'s docstring)."""
    return sigma if loss_noise is None else sigma / math.sqrt(1 + loss_noise ** -2)


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


def _own_pld(event: Event, steps: int, interval: float):
    """ε(σ of the joint Gaussian) of `event` over `steps` steps on the grid `interval`, for the events whose PLD dpmem
    builds itself (ELS's mixture, a Poisson or a banded cyclic Gaussian); None for the others (dp-accounting's
    accountants compose them)."""
    e = event
    if e.user_records is not None and e.accountant == "pld" and e.neighbouring == "add_remove" \
            and e.sampling == "poisson":
        return lambda s: _mixture_epsilon(s, e.delta, e.sample_rate, steps, int(e.user_records), interval=interval)
    banded = (e.sampling == "cyclic" and e.groups and e.dataset_size is not None
              and not (e.noise and e.noise[0] == "bisr"))
    if e.accountant == "pld" and e.user_records is None and e.neighbouring in RELATIONS \
            and (e.sampling == "poisson" or banded):
        # a banded strategy's at its group's rate, once a participation
        rate, count = ((group_rate(e.sample_rate, e.dataset_size, e.groups), math.ceil(steps / e.groups)) if banded
                       else (e.sample_rate, steps))
        return lambda s: _poisson_epsilon(s, e.delta, rate, count, e.neighbouring, interval=interval)
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


def epsilon_of(event: Event, steps: int) -> float:
    """ε at the event's δ after `steps` steps of `event` (inf if its σ is 0), each with the batch's noised loss where
    it has `loss_noise` (the module's docstring). Raises TypeError for a field that is not a number, ValueError for
    one out of range or for terms of another kind of run (`_check_terms`)."""
    e = event
    _numbers(sigma=e.sigma)
    _check(e.delta, e.sample_rate, steps)
    _check_terms(e.accountant, e.sampling, e.groups, e.noise, e.user_records)
    if e.accountant == "rc":
        if e.neighbouring != "add_remove":
            raise ValueError(f"accountant rc: neighbouring {e.neighbouring!r} is not supported, allowed add_remove")
        if e.sampling != "poisson":
            raise ValueError(f"accountant rc: sampling {e.sampling!r} is not supported, allowed poisson")
        if e.rc is None:
            raise ValueError("accountant rc: the event names no envelope (k, d, estimator)")
        rc.check_args(*e.rc)
    if steps == 0:
        return 0.0
    if e.sigma <= 0:
        return math.inf
    if e.accountant == "rc":
        return rc.rc_epsilon(e.sigma, e.delta, e.sample_rate, steps, *e.rc, PLD_DISCRETIZATION, e.loss_noise)
    own = _own_pld(e, steps, PLD_DISCRETIZATION)
    if own is not None:  # what PLDAccountant composes for `_event`, its one step kept: a run asks at each logged step
        return own(e.joint_sigma)
    acc = _accountant(e.accountant, e.neighbouring)
    composed = _event(e.joint_sigma, e.sample_rate, steps, e.sampling, e.dataset_size, e.groups, _tuple(e.noise),
                      e.user_records)
    if not acc.supports(composed):
        raise ValueError(f"accountant {e.accountant} does not support {e.sampling} sampling under {e.neighbouring}")
    return float(acc.compose(composed).get_epsilon(e.delta))


def epsilon_spent(sigma: float, delta: float, sample_rate: float, steps: int, accountant: str = "pld",
                  neighbouring: str = "add_remove", sampling: str = "poisson",
                  dataset_size: int | None = None, k: int = 32, d: float | None = None,
                  estimator: str = "hutch", loss_noise: float | None = None, groups: int | None = None,
                  noise: tuple | None = None, user_records: int | None = None) -> float:
    """`epsilon_of` the event these keywords name: epsilon after `steps` sampled Gaussian steps with noise
    multiplier `sigma` (inf if sigma is 0), each with the batch's noised loss when `loss_noise` is given.

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
    terms = {"accountant": accountant, "neighbouring": neighbouring, "sampling": sampling,
             "dataset_size": dataset_size, "k": k, "d": d, "estimator": estimator, "loss_noise": loss_noise,
             "groups": groups, "noise": noise, "user_records": user_records}
    return epsilon_of(Event.of(sigma, delta, sample_rate, terms), steps)


def composed_epsilon(releases: list[tuple[Event, int]], delta: float, accountant: str = "pld",
                     neighbouring: str = "add_remove") -> float:
    """Epsilon of releasing what several runs on the same data produced (a search's chosen result): their
    mechanisms composed at `delta` by `accountant` under `neighbouring`, each release an event and its steps; inf
    if any added no noise."""
    events = []
    for e, steps in releases:
        _check(delta, e.sample_rate, steps)
        if steps == 0:
            continue
        if e.sigma <= 0:
            return math.inf
        events.append(_event(e.joint_sigma, e.sample_rate, steps, e.sampling, e.dataset_size, e.groups,
                             _tuple(e.noise), e.user_records))
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


def calibrate_sigma(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "pld",
                    neighbouring: str = "add_remove", sampling: str = "poisson",
                    dataset_size: int | None = None, tolerance: float = 1e-3, k: int = 32, d: float | None = None,
                    estimator: str = "hutch", loss_noise: float | None = None, groups: int | None = None,
                    noise: tuple | None = None, user_records: int | None = None) -> float:
    """`sigma_for` the event these keywords name: the smallest noise multiplier of the gradient whose epsilon after
    `steps` steps (with the loss releases of `loss_noise`) is at most `epsilon`.

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
    terms = {"accountant": accountant, "neighbouring": neighbouring, "sampling": sampling,
             "dataset_size": dataset_size, "k": k, "d": d, "estimator": estimator, "loss_noise": loss_noise,
             "groups": groups, "noise": noise, "user_records": user_records}
    return Event.of(0.0, delta, sample_rate, terms).calibrated(epsilon, steps, tolerance).sigma


@functools.lru_cache(maxsize=256)  # a sweep over seeds or learning rates calibrates the same sigma once per process
def sigma_for(event: Event, epsilon: float, steps: int, tolerance: float = 1e-3) -> float:
    """The smallest noise multiplier of the gradient for which `event` (its own σ is not read) spends at most
    `epsilon` over `steps` steps, to `tolerance` (for rc relative above σ = 1). Raises TypeError for a field that is
    not a number, ValueError for a bad one, and `UnreachableTarget` for an ε no noise reaches."""
    e = event
    _numbers(epsilon=epsilon)
    _check(e.delta, e.sample_rate, steps)
    _check_terms(e.accountant, e.sampling, e.groups, e.noise, e.user_records)
    if not epsilon > 0:
        raise ValueError(f"epsilon={epsilon} must be > 0")
    if steps <= 0:
        raise ValueError(f"steps={steps} must be positive")
    rc_run = e.accountant == "rc"
    joint = replace(e, loss_noise=e.loss_noise if rc_run else None)  # rc's of the gradient's σ, the others' joint

    @functools.cache  # `_bracket` and `_root` ask for some σ twice
    def eps(s: float) -> float:
        return epsilon_of(replace(joint, sigma=s), steps)

    if rc_run:
        # bisection: rc has no dp-accounting event, and its epsilon is inf (not a number to interpolate) while the
        # +inf loss mass of the lower envelope tail exceeds delta
        k, d, estimator = e.rc or (None, None, None)
        lo, hi = _bracket(eps, epsilon, RC_MAX_SIGMA, f"epsilon={epsilon} at delta={e.delta} is unreachable by "
                          f"DP-SGD-RC (k={k}, d={d}, {estimator}) over {steps} steps")
        while hi - lo > tolerance * max(1.0, lo):  # relative above 1: k = 1 needs sigma ~ 1e5
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if eps(mid) <= epsilon else (mid, hi)
        return hi
    # a budget looser than the least noise's ε is refused by RDP's bound at once (RDP is above PLD's ε, and PLD at
    # σ = MIN_SIGMA needs a minute of buckets): what `_bracket` would conclude after halving down to MIN_SIGMA
    try:
        least = epsilon_of(replace(joint, sigma=MIN_SIGMA, accountant="rdp"), steps)
    except ValueError:  # an event RDP does not support (Poisson under replace-one): `_bracket` alone decides
        least = math.inf
    if epsilon >= least:
        raise UnreachableTarget(f"{epsilon:g} is looser than the epsilon of the least noise dpmem adds (multiplier "
                                f"{MIN_SIGMA:g}: {least:.4g} or less); a budget that large protects nothing: give a "
                                "smaller epsilon, or privacy=none for a non-private run")
    unreachable = (f"epsilon={epsilon} at delta={e.delta} is unreachable with sample rate {e.sample_rate:.4g} over "
                   f"{steps} steps")
    bracket = None
    coarse = _own_pld(e, steps, PLD_DISCRETIZATION * SEARCH_COARSENING)
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
            return bracket[1] / joint_sigma(1.0, e.loss_noise)
    lo, hi = bracket or _bracket(eps, epsilon, MAX_SIGMA, unreachable)
    return _root(eps, epsilon, lo, hi, tolerance) / joint_sigma(1.0, e.loss_noise)  # the gradient's, of the joint one
