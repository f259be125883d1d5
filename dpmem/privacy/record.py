"""What a run's ε is of, as frozen values: the privacy unit (`PrivacyUnit`), read from the configuration (or a
summary) once, where each reader used to ask privacy.unit and privacy.user_sampling again; and the privacy event
(`Event`), what dp-accounting composes, where the mechanism held a dict of keywords (issue 76)."""

from __future__ import annotations

from dataclasses import dataclass

from dpmem.config import ConfigError, enum_value
from dpmem.privacy.accounting import epsilon_spent, joint_sigma


@dataclass(frozen=True)
class PrivacyUnit:
    """What ε protects, and what a step samples and clips: a record (the default); or, under privacy.unit=user, a
    user of at most `k` records (privacy.records_per_user), sampled record by record and clipped per record (ELS:
    `sampling` records) or sampled and clipped as a whole (ULS: `sampling` users)."""
    user: bool = False
    sampling: str = "records"  # records, or users (ULS); a record-level run samples records
    k: int | None = None

    @classmethod
    def of(cls, privacy) -> PrivacyUnit:
        """The unit a run's privacy config asks for."""
        if enum_value(privacy.get("unit", "record")) != "user":
            return cls()
        k = privacy.get("records_per_user")
        return cls(True, enum_value(privacy.user_sampling), None if k is None else int(k))

    @classmethod
    def in_summary(cls, summary: dict) -> PrivacyUnit:
        """The unit a run's summary (or a ledger line) records it ran under."""
        if summary.get("unit") != "user":
            return cls()
        k = summary.get("records_per_user")
        return cls(True, str(summary.get("user_sampling") or "records"), None if k is None else int(k))

    @property
    def name(self) -> str:
        return "user" if self.user else "record"

    @property
    def uls(self) -> bool:
        """Users sampled and clipped as a whole (user-level sampling)."""
        return self.user and self.sampling == "users"

    @property
    def els(self) -> bool:
        """A user's records sampled one by one, each clipped alone, a user bounded to k of them."""
        return self.user and self.sampling == "records"

    def terms(self, n: int, users: int | None, batch_size: int) -> dict:
        """What the unit makes of the accounting of `n` records of `users` users at `batch_size` a step: `units`,
        the number of them (what δ = auto and δ·n read); `sample_rate`, the rate at which a step samples what it
        clips (records; ULS: users); `user_records`, ELS's k (a user of at most k records, each sampled at that rate:
        `accounting._event`); `uls`. Raises ConfigError where the data names no users or the batch outnumbers them."""
        if not self.user:
            return {"units": n, "sample_rate": batch_size / n, "user_records": None, "uls": False}
        if users is None:
            raise ConfigError("privacy.unit", "user: the data names no users; set data.columns.user (data=csv|jsonl) "
                              "or make them up with data.users=N")
        if self.uls and batch_size > users:
            raise ConfigError("train.batch_size", f"{batch_size} users a step (ULS samples users) of {users}: "
                              f"allowed at most {users}")
        return {"units": users, "sample_rate": batch_size / (users if self.uls else n),
                "user_records": None if self.uls else self.k, "uls": self.uls}


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
        """From epsilon_spent's keywords after (σ, δ, q, steps)."""
        rc = (terms["k"], terms["d"], terms["estimator"]) if terms.get("accountant") == "rc" else None
        return cls(sigma, delta, sample_rate, **{k: v for k, v in terms.items() if k not in ("k", "d", "estimator")},
                   rc=rc)

    def terms(self) -> dict:
        """epsilon_spent's keywords after (σ, δ, q, steps)."""
        out = {"accountant": self.accountant, "neighbouring": self.neighbouring, "sampling": self.sampling,
               "dataset_size": self.dataset_size, "loss_noise": self.loss_noise, "groups": self.groups,
               "noise": self.noise, "user_records": self.user_records}
        return {**out, **dict(zip(("k", "d", "estimator"), self.rc))} if self.rc else out

    def epsilon(self, steps: int) -> float:
        return epsilon_spent(self.sigma, self.delta, self.sample_rate, steps, **self.terms())

    def line(self) -> dict:
        """What a privacy.jsonl line records of the event (beside its ε and steps), for `from_line` to read back: σ
        accounted per step (the gradient's and the loss's releases as one multiplier; None for rc, whose envelope
        the line does not hold), and the analysis's terms; accountant, relation and σ None where nothing is
        accounted."""
        accounted = self.delta is not None
        return {"delta": self.delta,
                "sigma_accounted": joint_sigma(self.sigma, self.loss_noise) if accounted and not self.rc else None,
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


def line_epsilon(line: dict) -> float | None:
    """ε recomputed from what a privacy.jsonl line says it was computed from (`Event.from_line`) at the steps it
    records: what a damaged or edited ε field cannot lower. None where the line cannot say (rc, whose envelope the
    line does not hold, or a field missing or not a number)."""
    try:
        if line.get("accountant") not in ("pld", "rdp") or not line.get("steps_done"):
            return None
        return Event.from_line(line).epsilon(int(line["steps_done"]))
    except (KeyError, TypeError, ValueError):
        return None
