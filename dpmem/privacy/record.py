"""What a run's ε is of: the privacy unit (`PrivacyUnit`), a frozen value read from the configuration (or a
summary) once, where each reader used to ask privacy.unit and privacy.user_sampling again; the privacy event itself
(`accounting.Event`, what dp-accounting composes) is the accountant's; the run's privacy as one value (`Record`:
the event, the unit, the loss's release, whether private), from which its summary's privacy fields derive; and the
ε a ledger line's event gives back (`line_epsilon`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpmem.config import ConfigError, enum_value
from dpmem.privacy.accounting import Event, group_rate


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
class Record:
    """A run's privacy as one value: its event (δ None: nothing accounted: privacy=none, or a method that is not
    private), its unit and how many of them the data holds (`units`: records, or users), the training loss's
    release (private, in ε; exact, outside it; none), and whether its method is private. The summary's privacy
    fields are derived from it (`summary`)."""
    event: Event
    unit: PrivacyUnit = PrivacyUnit()
    units: int | None = None
    loss_release: str = "exact"
    private: bool = True

    @property
    def accounted(self) -> bool:
        return self.event.delta is not None

    def summary(self) -> dict:
        """The summary's privacy fields that the record says: ε spent so far (0 before a step; ∞ where nothing is
        accounted), δ, σ, the joint σ dp-accounting composes, q, the analysis's terms, and the unit."""
        e, accounted, private = self.event, self.accounted, self.private
        return {
            "private": private, "epsilon_spent": 0.0 if accounted else math.inf, "delta": e.delta,
            "delta_times_n": e.delta * self.units if accounted else None, "sigma": e.sigma if private else None,
            # the multiplier dp-accounting composes per step: the gradient's and the loss's releases as one
            "sigma_accounted": e.joint_sigma if accounted and e.accountant != "rc" else None,
            "train_loss_release": self.loss_release if accounted else None,
            "loss_sigma": e.sigma * e.loss_noise if self.loss_release == "private" else None,
            "sample_rate": e.sample_rate, "sampling": e.sampling,
            "accountant": e.accountant if accounted else None, "neighbouring": e.neighbouring if accounted else None,
            # correlated noise: the strategy and what its accounting reads (`dpmem.privacy.accounting._event`)
            "noise": (e.noise[0] if e.noise else "independent") if private else None,
            "bands": e.noise[1] if e.noise else None, "noise_horizon": e.noise[2] if e.noise else None,
            "groups": e.groups,
            "group_rate": group_rate(e.sample_rate, e.dataset_size, e.groups) if e.groups else None,
            "privacy_analysis": e.analysis(self.unit.uls) if accounted else None,
            # what ε protects: a record, or a user's records (ULS: sampled and clipped by user; ELS: by record)
            "unit": self.unit.name if private else None,
            **({"user_sampling": self.unit.sampling, "records_per_user": self.unit.k, "users": self.units}
               if private and self.unit.user else {}),
        }


def summary_line(summary: dict) -> dict:
    """What a run's summary says of its accounting (`Record.summary`'s fields), named as a privacy.jsonl line names
    them (`Event.line`), None fields left out: what `dpmem report` reads where an older ledger's lines lack them."""
    s = summary
    line = {k: s.get(k) for k in ("steps_done", "sigma", "sigma_accounted", "sample_rate", "accountant", "delta",
                                  "sampling", "groups", "users", "neighbouring")}
    if s.get("user_sampling") == "records":  # ELS: a user of at most k records
        line["user_records"] = s.get("records_per_user")
    if s.get("noise") not in (None, "independent"):  # correlated noise: the strategy its accounting reads
        line["strategy"] = [s["noise"], s.get("bands"), s.get("noise_horizon")]
    line.update(epsilon=s.get("epsilon_spent"), dataset_size=s.get("n_train"))
    return {k: v for k, v in line.items() if v is not None}


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
