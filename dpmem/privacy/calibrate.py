"""A run's privacy from its configuration, in one place: every refusal of a privacy setting that depends on
another key or on the method (`check`; config.py keeps the single keys' ranges), the one way from a config to the
run's privacy record (`record_of`: its Event, unit and loss release), and the run's mechanism with σ calibrated or
given (`calibrate`)."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import torch

from dpmem import distributed
from dpmem.config import (Accountant, ConfigError, LossRelease, Neighbouring, Noise, Objective, Sampling,
                          accounted, asked_budget, enum_value, resolve_delta, resolved_sampling)
from dpmem.privacy.accounting import MIN_SIGMA, Event, UnreachableTarget
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.state import MechanismState
from dpmem.privacy.randomness import Draws, key_of, os_key, seed_key
from dpmem.privacy.record import PrivacyUnit, Record
from dpmem.privacy.strategies import make_strategy


def check(cfg, spec) -> None:
    """Every refusal of a privacy setting that depends on another key or on the method (`spec`, its MethodSpec):
    a budget and a fixed σ together, correlated noise and its bands, sampling and accountant, the privacy unit and
    what it needs (config.py checks each key's own range; `dpmem.methods.validate` runs both). Raises ConfigError
    naming the key."""
    t, p, m = cfg.train, cfg.privacy, cfg.method
    sigma = p.get("noise_multiplier")
    if sigma is not None and p.epsilon is not None:
        raise ConfigError("privacy.noise_multiplier", f"{sigma:g} fixes σ, and privacy.epsilon={p.epsilon:g} asks "
                          "for σ calibrated to it: give one (privacy.epsilon=null with a fixed σ)")
    correlated = p.get("noise", Noise.independent) != Noise.independent
    if correlated and not accounted(p):
        raise ConfigError("privacy.noise", f"{enum_value(p.noise)} correlates the noise of a private run, and this "
                          "one adds none (privacy=none: no privacy.epsilon or privacy.noise_multiplier); allowed "
                          "without a budget: independent")
    bands = p.get("bands")
    if bands is not None and (isinstance(bands, bool) or bands < 1 or (bands > 1 and not correlated)):
        raise ConfigError("privacy.bands", f"{bands}: the bands of a correlated strategy (privacy.noise=bandmf|bisr), "
                          "a positive integer; independent noise has none (leave it null)")
    if correlated and p.get("bands") is None:
        raise ConfigError("privacy.bands", f"privacy.noise={enum_value(p.noise)} needs its number of bands, e.g. "
                          "privacy.bands=4 (bandmf: b − 1 noise buffers; bisr: p draws per step)")
    k, by_user = p.get("records_per_user"), PrivacyUnit.of(p).user
    if k is not None and (isinstance(k, bool) or k < 1 or not by_user):
        raise ConfigError("privacy.records_per_user", f"{k}: the most records of one user a step (ULS) or the run "
                          "(ELS) uses, a positive integer, with privacy.unit=user")
    if by_user and k is None:
        raise ConfigError("privacy.records_per_user", "privacy.unit=user needs the most records of one user that "
                          "count, e.g. privacy.records_per_user=4 (the rest are left out: docs/privacy.md)")
    if by_user and correlated:
        raise ConfigError("privacy.noise", f"{enum_value(p.noise)}: correlated noise is accounted per record "
                          "(cyclic groups of records); with privacy.unit=user allowed: independent")
    if by_user and p.neighbouring != Neighbouring.add_remove:
        raise ConfigError("privacy.neighbouring", "user-level privacy is accounted for adding or removing one "
                          "user; allowed with privacy.unit=user: add_remove")
    users = cfg.data.get("users")
    user_column = (cfg.data.get("columns") or {}).get("user")
    if not by_user and (users is not None or user_column is not None):  # refused, not ignored: ε would be a record's
        key, value = ("data.users", users) if users is not None else ("data.columns.user", user_column)
        raise ConfigError(key, f"{value} names the data's users, which only privacy.unit=user reads: this run's ε "
                          "protects one record (privacy.unit=record). For a user's: privacy.unit=user "
                          f"privacy.records_per_user=K; for a record's, leave {key} unset")
    _noise(cfg, spec)
    _unit(cfg, spec)
    if not spec.private or not accounted(p):  # privacy=none: a private method clips, nothing is accounted
        return
    if sigma is not None and sigma < MIN_SIGMA:  # what calibration never goes below: its PLD outgrows memory
        raise ConfigError("privacy.noise_multiplier", f"{sigma:g} is below {MIN_SIGMA:g}, the least noise dpmem "
                          "accounts (the ε of less protects nothing, and accounting it takes minutes and "
                          f"gigabytes); allowed: {MIN_SIGMA:g} or more, or privacy=none for a non-private run")
    if t.objective == Objective.train_loss and p.train_loss != LossRelease.private:
        raise ConfigError("train.objective", "train_loss chooses among private runs by their training loss, which "
                          f"privacy.train_loss={enum_value(p.train_loss)} releases outside epsilon (or not at "
                          "all); allowed: privacy.train_loss=private (noised, in epsilon), or "
                          "train.objective=metric")
    if t.sampling == Sampling.shuffle:
        raise ConfigError("train.sampling", "shuffle has no privacy accountant; allowed for private "
                          "training: poisson (default), fixed (with privacy.accountant=rdp, "
                          "privacy.neighbouring=replace_one)")
    if t.sampling == Sampling.fixed and (
            p.accountant != Accountant.rdp or p.neighbouring != Neighbouring.replace_one):
        raise ConfigError("train.sampling", "fixed-size sampling is accounted only by privacy.accountant=rdp "
                          "with privacy.neighbouring=replace_one")
    if (t.sampling in (Sampling.poisson, Sampling.auto)
            and p.accountant == Accountant.rdp and p.neighbouring == Neighbouring.replace_one):
        raise ConfigError("privacy.accountant", "rdp accounts Poisson sampling only under add_remove; "
                          "allowed with replace_one: pld")
    randomized = spec.accountant == "rc"  # the accountant privacy.accountant=auto picks for it
    if randomized and p.accountant in (Accountant.pld, Accountant.rdp):
        raise ConfigError("privacy.accountant", f"{m.name} clips with estimated norms, which pld and rdp do not "
                          "account for (epsilon would be understated); allowed: rc, auto")
    if not randomized and p.accountant == Accountant.rc:
        raise ConfigError("privacy.accountant", f"rc accounts randomized clipping (dp-sgd-rc), not {m.name}; "
                          "allowed: auto, pld, rdp")
    if randomized and p.neighbouring != Neighbouring.add_remove:
        raise ConfigError("privacy.neighbouring", f"the rc accountant of {m.name} is for add_remove only; "
                          "allowed: add_remove")


def _noise(cfg, spec) -> None:
    """Correlated noise (privacy.noise) and cyclic sampling come together, for a method whose accountant has an
    analysis of them."""
    p, m = cfg.privacy, cfg.method
    noise = p.get("noise", Noise.independent)
    cyclic = resolved_sampling(cfg, spec.private) == "cyclic"
    if noise == Noise.independent:
        if cyclic:
            raise ConfigError("train.sampling", "cyclic samples the groups of correlated noise (privacy.noise="
                              "bandmf|bisr); independent noise is amplified more by poisson (the default)")
        return
    name = enum_value(noise)
    if not spec.private:
        raise ConfigError("privacy.noise", f"{name}: {m.name} is not private and adds no noise; allowed: "
                          "independent")
    if spec.accountant == "rc":
        raise ConfigError("privacy.noise", f"{name}: {m.name}'s accountant (randomized clipping's envelope) has "
                          "no analysis of correlated noise; allowed: independent")
    if not cyclic:
        raise ConfigError("train.sampling", f"privacy.noise={name} is accounted under cyclic Poisson sampling "
                          "(a record joins only every G-th step); set train.sampling=cyclic (or auto)")


def _unit(cfg, spec) -> None:
    """privacy.unit=user: a private method whose accountant has a user-level analysis, under Poisson sampling;
    ULS (user_sampling=users) for the methods whose step clips per-sample gradients (`MethodSpec.no_uls` says
    why a step cannot)."""
    t, p, m = cfg.train, cfg.privacy, cfg.method
    unit = PrivacyUnit.of(p)
    if not unit.user:
        return
    if not spec.private:
        raise ConfigError("privacy.unit", f"user: {m.name} is not private and protects no one; allowed: record")
    if spec.accountant == "rc":
        raise ConfigError("privacy.unit", f"user: {m.name}'s accountant (randomized clipping's envelope) bounds "
                          "one record's random sensitivity, not a user's; allowed: record")
    if t.sampling not in (Sampling.poisson, Sampling.auto):
        raise ConfigError("train.sampling", f"{enum_value(t.sampling)}: user-level privacy is accounted under "
                          "Poisson sampling (of users, or of records for ELS); allowed: poisson, auto")
    els = unit.els
    if els and p.accountant == Accountant.rdp:
        raise ConfigError("privacy.accountant", "rdp: ELS's user is a mixture of Gaussians, which dp-accounting "
                          "accounts by PLD alone; allowed: pld, auto")
    if not els and spec.no_uls:
        raise ConfigError("privacy.user_sampling", f"users: {m.name} {spec.no_uls}; allowed: records (ELS)")


def accountant_of(privacy, spec) -> str:
    """privacy.accountant, or for auto the one the method names (`spec`, its MethodSpec: pld; rc for randomized
    clipping)."""
    accountant = enum_value(privacy.accountant)
    return spec.accountant if accountant == "auto" else accountant


def record_of(privacy, spec, n: int, batch_size: int, steps: int, sampling: str, restart: int | None = None,
              users: int | None = None, rc: dict | None = None, accounted: bool = True) -> Record:
    """A run's privacy from its configuration and its data's size alone, before anything is built (a plan, a
    private search, a report, `calibrate`): its Record, whose event is of σ 0 (to be `Event.calibrated`, or given
    its σ). `restart`: a projected method's refresh F (correlated noise restarts there: `noise_terms`). `users`: how
    many users the training records have (privacy.unit=user). `rc`: randomized clipping's envelope ({k, d,
    estimator}, from the model). `accounted` False: nothing is (privacy=none, or a method that is not private): no
    δ, and the loss exact (or none, where privacy.train_loss=none asks for none). Raises ConfigError naming the
    key."""
    unit = PrivacyUnit.of(privacy)
    terms = unit.terms(n, users, batch_size)
    loss_release = (enum_value(privacy.train_loss) if accounted
                    else "none" if enum_value(privacy.train_loss) == "none" else "exact")
    keywords = {"accountant": accountant_of(privacy, spec), "neighbouring": enum_value(privacy.neighbouring),
                "sampling": sampling, "dataset_size": terms["units"] if terms["uls"] else n,  # what a step samples
                "loss_noise": privacy.loss_noise if loss_release == "private" else None,  # in ε only where private
                **noise_terms(privacy, n, batch_size, steps, sampling, restart), "user_records": terms["user_records"]}
    if keywords["accountant"] == "rc" and rc is not None:  # the envelope of randomized clipping depends on the model
        if accounted and terms["sample_rate"] >= 1:
            raise ConfigError("train.batch_size", f"{batch_size} samples every record at every step (sampling rate "
                              f"{terms['sample_rate']:g}): the rc accountant needs a rate below 1 (a logical batch "
                              "smaller than the training set)")
        keywords.update(k=rc["k"], d=rc["d"], estimator=rc["estimator"])
    delta = resolve_delta(privacy.delta, terms["units"]) if accounted else None
    return Record(Event.of(0.0, delta, terms["sample_rate"], keywords), unit, terms["units"], loss_release,
                  spec.private)


def noise_terms(privacy, n: int, batch_size: int, steps: int, sampling: str, restart: int | None = None) -> dict:
    """Correlated noise's accounting terms: `groups`, cyclic sampling's G (bandmf: its bands, the separation its
    amplified analysis needs; bisr: the steps of an epoch, floor(n/B), the most separation the data allows, since
    bisr's participations cost sensitivity), and `noise`, the strategy (name, bands, horizon): its coefficients are
    made for the run's steps, or a projected method's refresh window where the correlation restarts. Both None for
    independent noise. Raises ConfigError where a group is smaller than the batch."""
    name = enum_value(privacy.get("noise", "independent"))
    if sampling != "cyclic" or name == "independent":
        return {"groups": None, "noise": None}
    bands = int(privacy.bands)
    groups = bands if name == "bandmf" else max(1, n // batch_size)
    if n // groups < batch_size:
        raise ConfigError("privacy.bands", f"{bands} groups of {n} records hold {n // groups} each, fewer than "
                          f"train.batch_size={batch_size}: bandmf samples a step's batch from one group; allowed "
                          f"at most {n // batch_size} bands (or a smaller batch)")
    horizon = min(steps, restart) if restart else steps
    return {"groups": groups, "noise": (name, min(bands, horizon), horizon)}


def _adam_like(method) -> bool:
    """A method whose update divides by the gradients' root mean square (Adam's moments): its step shrinks with a
    step's noise, which correlated noise makes larger."""
    return method.name in ("grape", "galore-dp-naive") or enum_value(method.get("optimizer", "")) in ("adam", "adamw")


def step_noise_matched_lr(lr: float, event: Event, epsilon: float, steps: int) -> float:
    """docs/benchmarks/correlated.md's rule for correlated noise under an Adam-like method: the learning rate times
    the std of one step's noise over independent noise's, σ ÷ σ_independent (Poisson sampling at the same ε, δ, q
    and steps) × the norm of C⁻¹'s last row over the strategy's horizon. It reads no data."""
    name, bands, horizon = event.noise
    independent = replace(event, noise=None, groups=None, sampling="poisson").calibrated(epsilon, steps)
    row = float(torch.linalg.vector_norm(torch.as_tensor(make_strategy(name, bands, horizon).noising_coefs(horizon))))
    return lr * event.sigma / independent.sigma * row


def calibrate(cfg, spec, n: int, steps: int, sampling: str, device: torch.device, rc: dict | None = None,
              observers: tuple = (), users: int | None = None) -> GaussianMechanism:
    """The mechanism of a run of `cfg` (its method's MethodSpec `spec`) over `n` records for `steps` steps: its
    Record (`record_of`) with σ calibrated to privacy.epsilon at δ or given (`_noised`), the noise keyed from the
    OS unless privacy.noise_seed is given (rank 0's key on every rank: dpmem.distributed), the batches' sampler, the
    clipping plan, and the summary's privacy fields. `rc`: randomized clipping's envelope ({k, d, d_max_layer,
    estimator}, from the model) where the accountant is rc. A non-private method's is `private=False`: it says what
    the run releases, and draws nothing. Raises ConfigError naming the key."""
    p, m, t = cfg.privacy, cfg.method, cfg.train
    asked = asked_budget(p)  # None: privacy=none
    # a budget given to a non-private method buys nothing: said once, and kept in the summary, so that a sweep
    # over privacy=eps2,eps8 with method=adam is seen to have run adam twice
    ignored = f"{asked} has no effect: {m.name} is not private" if not spec.private and asked else None
    _warn(ignored)
    restart = m.get("refresh") if spec.private else None  # a projected method's window: correlated noise restarts
    record = record_of(p, spec, n, t.batch_size, steps, sampling, restart, users, rc,
                       accounted=spec.private and asked is not None)  # privacy=none: a private method clips only
    accounted, event, fixed = record.accounted, record.event, p.get("noise_multiplier")
    if accounted and event.delta * record.units >= 1:
        _warn(f"delta = {event.delta:.3g} is at least 1/n = {1 / record.units:.3g} (n = {record.units} "
              f"{record.unit.name}s): at that delta a mechanism that publishes one random {record.unit.name}'s data "
              "whole is still (epsilon, delta)-DP; the default privacy.delta=auto is min(1e-5, 1/n^1.1)")
    record, target = _noised(record, p, steps) if accounted else (record, p.epsilon)
    matched = _step_noise_matched(record.event, m, t.lr, target, steps) if accounted else None
    # what an adversary holding config.yaml can replay: ε does not hold against one
    derivable = [what for what, seed in (("batches", p.sampler_seed), ("noise", p.noise_seed)) if seed is not None]
    if accounted and derivable:
        _warn(f"privacy.{'sampler' if 'batches' in derivable else 'noise'}_seed is set: the run's "
              f"{' and '.join(derivable)} can be derived from its config, and epsilon does not hold against anyone "
              "who has it (for debugging and tests)")
    plan, private_loss, q = spec.clipping(m), record.loss_release == "private", event.sample_rate
    summary = {**record.summary(), "epsilon_target": target if accounted else None, "privacy_ignored": ignored,
               # privacy.noise_multiplier: σ was given, and epsilon_target is what it spends over the planned steps
               "noise_multiplier_fixed": float(fixed) if accounted and fixed is not None else None,
               "derivable_from_config": derivable if accounted else None,
               "loss_bound": p.loss_bound if private_loss else None,
               "max_grad_norm": m.max_grad_norm if spec.private else None,
               "clipping": plan.name if plan is not None else None,
               "rc_accountant": rc if event.accountant == "rc" else None, "lr_step_noise_matched": matched}
    strategy = make_strategy(*event.noise) if event.noise else None
    noise = Draws(key_of(p.noise_seed), "noise", device) if spec.private and device.type != "meta" else None
    return GaussianMechanism(record.event.sigma, m.max_grad_norm if spec.private else math.inf,
                             q * event.dataset_size, sample_rate=q,
                             loss_bound=p.loss_bound if private_loss else math.inf,
                             loss_sigma=summary["loss_sigma"] or 0.0, observers=tuple(observers), plan=plan,
                             record=record, summary=summary, strategy=strategy,
                             restart=restart if strategy is not None else None,
                             state=MechanismState(noise, _sampler(cfg, accounted)))


def _sampler(cfg, accounted: bool) -> Draws:
    """The batches' draws: keyed from privacy.sampler_seed if given; for an accounted run from the OS (rank 0's, on
    every rank), since ε assumes nobody knows which steps held a record; otherwise from the run seed (a baseline's
    batches reproduce)."""
    p, t = cfg.privacy, cfg.train
    return Draws(os_key() if accounted and p.sampler_seed is None
                 else seed_key(t.seed if p.sampler_seed is None else p.sampler_seed), "batches")


def _warn(what: str | None) -> None:
    """A warning of the run's privacy, said once (by rank 0 under torchrun)."""
    if what and distributed.is_main():
        print(f"dpmem: warning: {what}", file=sys.stderr)


def _noised(record: Record, p, steps: int) -> tuple[Record, float]:
    """An accounted record at its σ: privacy.noise_multiplier's, whose ε over the planned steps is then the run's
    target, or the least σ that meets privacy.epsilon (calibrated on rank 0 under torchrun, every rank taking its
    σ or its error); and that target."""
    event, fixed = record.event, p.get("noise_multiplier")
    if fixed is not None:
        event = replace(event, sigma=float(fixed))
        return replace(record, event=event), distributed.from_main(event.epsilon(steps) if distributed.is_main()
                                                                    else None)
    if event.user_records is not None and distributed.is_main():  # a minute or two without a word else
        print(f"dpmem: calibrating σ to ε = {p.epsilon:g} per user (ELS: each step a mixture of "
              f"{event.user_records + 1} Gaussians, a privacy loss distribution built per σ tried); this can take "
              "minutes", file=sys.stderr)
    try:
        found = event.calibrated(p.epsilon, steps).sigma if distributed.is_main() else None
    except UnreachableTarget as e:
        found = str(e)
    sigma = distributed.from_main(found)
    if isinstance(sigma, str):
        raise ConfigError("privacy.epsilon", sigma)
    return replace(record, event=replace(event, sigma=sigma)), p.epsilon


def _step_noise_matched(event: Event, m, lr: float, target: float, steps: int) -> float | None:
    """Correlated noise under an Adam-like method (`step_noise_matched_lr`): the rate, said where train.lr is more
    than 10 % off it (rank 0 only, which alone has the σ's); None otherwise."""
    if not (event.noise and _adam_like(m) and lr > 0 and distributed.is_main()):
        return None
    matched = step_noise_matched_lr(lr, event, target, steps)
    if not 0.9 <= lr / matched <= 1.1:
        _warn(f"train.lr={lr:g} with privacy.noise={event.noise[0]}: a step's noise is {matched / lr:.2f}x "
              "independent noise's (sigma ratio times the norm of C^-1's last row), and Adam's step shrinks as much; "
              f"the step-noise-matched rate, a rule that reads no data, is train.lr={matched:.3g} "
              "(docs/benchmarks/correlated.md)")
    return matched
