"""What a run's ε is of: the privacy unit (`PrivacyUnit`), a frozen value read from the configuration (or a
summary) once, where each reader used to ask privacy.unit and privacy.user_sampling again; the privacy event itself
(`accounting.Event`, what dp-accounting composes) is the accountant's; and the ε a ledger line's event gives back
(`line_epsilon`)."""

from __future__ import annotations

from dataclasses import dataclass

from dpmem.config import ConfigError, enum_value
from dpmem.privacy.accounting import Event


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
