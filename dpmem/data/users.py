"""Who wrote each training record, for user-level privacy (privacy.unit=user, docs/privacy.md "The privacy unit").

A data set's users are a column of user ids, one per training record (`DataBundle.users`): read from a file's
column (data.columns.user, csv/jsonl: each distinct value one user), or made up for a data set that has none
(data.users=N: each record given to one of N users by a heavy-tailed law, so that a few users write many records and
most write one or two, as in e-mail and review corpora). An id is a 63-bit number: a file's value hashed, a made-up
user's number; every per-user draw is keyed by it, so that adding or removing one user changes no other user's
records or choices (what the user-level guarantee needs of the pipeline).

- `Users`: each user's records (a CSR layout over the training split), built once.
- `bounded`: ELS's contribution bound, applied once to the data: each user keeps at most k of its records, chosen
  by a draw keyed by (seed, user id), the rest left out of training.
- `Users.batch`: ULS's step: the records of the users a step sampled, at most k per user chosen by the step's draw,
  laid out k slots to a user (-1: an empty slot).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from dpmem.config import ConfigError
from dpmem.privacy.record import PrivacyUnit

ZIPF = 1.0  # data.users: user u (1-based) writes a record with probability ∝ u^-ZIPF


def ids_of(values) -> torch.Tensor:
    """A file's user values (any JSON scalar; 7 and "7" one user) as 63-bit ids, by hash: what a value is, not where
    it comes in the file."""
    return torch.tensor([int.from_bytes(hashlib.blake2b(str(v).strip().encode(), digest_size=8).digest(), "little")
                         >> 1 for v in values], dtype=torch.int64)


def made_up(n: int, users: int, seed: int) -> torch.Tensor:
    """data.users: n records given to `users` users, user u (1-based) with probability ∝ u^-ZIPF (Zipf's law, seeded
    by `seed`): heavy-tailed counts, a few users with many records, many with one or none."""
    if users < 1:
        raise ConfigError("data.users", f"{users}: the number of users, a positive integer")
    weights = np.arange(1, users + 1, dtype=np.float64) ** -ZIPF
    rng = np.random.default_rng([seed, 0x05E125])
    return torch.from_numpy(rng.choice(users, size=n, p=weights / weights.sum()).astype(np.int64))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a uint64 array's values scrambled (a keyed priority per (user, record) pair)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _priorities(users: np.ndarray, places: np.ndarray, key: int) -> np.ndarray:
    """A pseudo-random priority for each record, keyed by (key, its user's id, its place among that user's records):
    a user's choice depends on nothing of the other users."""
    with np.errstate(over="ignore"):
        return _mix(_mix(users.astype(np.uint64) ^ np.uint64(key & 0xFFFFFFFFFFFFFFFF)) + places.astype(np.uint64))


class Users:
    """The users of a training split: `order` holds the record indices user by user (each user's in the split's
    order), user i's from `starts[i]` to `starts[i + 1]`; `ids` its id."""

    def __init__(self, users: torch.Tensor):
        column = users.numpy()
        self.ids, counts = np.unique(column, return_counts=True)
        self.order = np.argsort(column, kind="stable")
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.counts = counts

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def places(self) -> np.ndarray:
        """Each record's place among its user's records (0-based), in `order`."""
        return np.arange(len(self.order)) - np.repeat(self.starts[:-1], self.counts)

    def batch(self, chosen: np.ndarray, k: int, key: int) -> torch.Tensor:
        """ULS: the records of users `chosen` (indices into `ids`), at most k each, a user of more chosen by
        priorities keyed by (`key`, user id), as a (len(chosen) · k,) index with -1 in the empty slots."""
        out = np.full((len(chosen), k), -1, dtype=np.int64)
        for row, u in enumerate(chosen):
            records = self.order[self.starts[u]:self.starts[u + 1]]
            if len(records) > k:
                rank = _priorities(np.full(len(records), self.ids[u]), np.arange(len(records)), key)
                records = np.sort(records[np.argsort(rank, kind="stable")[:k]])
            out[row, :len(records)] = records
        return torch.from_numpy(out.reshape(-1))


def bounded(users: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """ELS's contribution bound: the training records kept (sorted indices), at most k per user, a user of more
    keeping the k of least priority keyed by (`seed`, user id)."""
    u = Users(users)
    rank = _priorities(np.repeat(u.ids, u.counts), u.places, seed)
    # within each user, its records ordered by priority: lexsort sorts by the last key first
    by_user = np.lexsort((rank, np.repeat(np.arange(len(u)), u.counts)))
    keep = u.places < k  # the first k of each user's block, once each block is ordered by priority
    return torch.from_numpy(np.sort(u.order[by_user][keep]))


def describe(users: torch.Tensor, k: int | None = None) -> dict:
    """The summary's account of a split's users: how many, their records (most, median), and under a bound of k
    per user how many records exceed it."""
    counts = Users(users).counts
    said = {"users": int(len(counts)), "records_per_user_max": int(counts.max()),
            "records_per_user_median": float(np.median(counts))}
    if k is not None:
        said["records_over_bound"] = int(np.maximum(counts - k, 0).sum())
    return said


def for_training(privacy, data, seed: int):
    """(the data a run trains on, the summary's account of its users): under privacy.unit=user, ELS's bound applied
    (at most privacy.records_per_user records of each user, chosen keyed by `seed`, data.split_seed: a choice that
    reads no record, so it may be public); ULS keeps every record and bounds each step instead. Unchanged, None for
    a record-level run. Raises ConfigError where the data names no users, or the bound exceeds every user's records."""
    from dataclasses import replace

    unit = PrivacyUnit.of(privacy)
    if not unit.user:
        return data, None
    if data.users is None:
        raise ConfigError("privacy.unit", "user: the data names no users; set data.columns.user (data=csv|jsonl) or "
                          "make them up with data.users=N")
    k = unit.k
    said = describe(data.users, k)
    most = said["records_per_user_max"]
    if k > most:  # ULS lays out k slots per sampled user, ELS accounts a mixture of k + 1 Gaussians
        raise ConfigError("privacy.records_per_user", f"{k} is more than any user's records (the most: {most}): a "
                          "larger bound uses no more records, and costs memory (ULS: k slots a user) or ε (ELS); "
                          f"allowed: 1..{most}")
    if unit.els:  # ELS: bounded once
        kept = bounded(data.users, k, seed)
        data = replace(data, train={name: column[kept] for name, column in data.train.items()},
                       users=data.users[kept])
        said["records_left_out"] = said.pop("records_over_bound")
    return data, said


def count(data) -> int | None:
    """How many users the training records have (None: the data names none)."""
    return None if data.users is None else int(torch.unique(data.users).numel())
