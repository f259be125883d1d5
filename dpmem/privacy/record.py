"""What a run's ε is of: the privacy unit, as one frozen value read from the configuration (or a summary) once,
where each reader used to ask privacy.unit and privacy.user_sampling again (issue 76)."""

from __future__ import annotations

from dataclasses import dataclass

from dpmem.config import enum_value


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
