"""Samplers that draw the example indices of each logical step, matching what the accountant assumes. Each step's
(or, for shuffling, each epoch's) indices come from a draw of the sampler's secret key (`dpmem.privacy.randomness`):
step t's batch depends on the key and t alone."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from dpmem.privacy.randomness import Draws


def _indices(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.int64))


def poisson_batches(n: int, sample_rate: float, steps: int, draws: Draws) -> Iterator[torch.Tensor]:
    """Each example joins each step independently with probability `sample_rate` (batch sizes vary, may be 0)."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate={sample_rate}: a probability, in (0, 1]")
    for _ in range(steps):
        yield _indices(np.flatnonzero(draws.numpy().random(n) < sample_rate))


def fixed_batches(n: int, batch_size: int, steps: int, draws: Draws) -> Iterator[torch.Tensor]:
    """`batch_size` examples drawn uniformly without replacement, independently at every step."""
    for _ in range(steps):
        yield _indices(draws.numpy().choice(n, batch_size, replace=False))


def shuffled_batches(n: int, batch_size: int, steps: int, draws: Draws) -> Iterator[torch.Tensor]:
    """Epochs of shuffled fixed-size batches (the last one of an epoch may be smaller). Non-private only."""
    done = 0
    while True:
        perm = _indices(draws.numpy().permutation(n))
        for start in range(0, n, batch_size):
            if done == steps:
                return
            yield perm[start:start + batch_size]
            done += 1


def cyclic_batches(n: int, batch_size: int, groups: int, steps: int, draws: Draws) -> Iterator[torch.Tensor]:
    """Cyclic Poisson sampling (Choquette-Choo et al. 2023): the records split into `groups` fixed groups by a
    permutation keyed from the sampler's key (drawn once, whatever the step); step t samples group t mod G, each of
    its records joining independently at the group's rate B / floor(n/G) (`dpmem.privacy.accounting.group_rate`).
    A record can join only every G-th step: what correlated noise's accounting needs."""
    if not 1 <= groups <= n // batch_size:
        raise ValueError(f"groups={groups}: allowed 1 to n // batch_size = {n // batch_size}")
    members = np.array_split(Draws(draws.key, "groups").numpy().permutation(n), groups)
    rate = batch_size / (n // groups)
    for t in range(steps):
        group = members[t % groups]
        yield _indices(np.sort(group[draws.numpy().random(len(group)) < rate]))


def user_batches(users, sample_rate: float, k: int, steps: int, draws: Draws) -> Iterator[torch.Tensor]:
    """ULS (privacy.unit=user): each user joins each step independently with probability `sample_rate`, and brings at
    most k of its records, a user of more bringing k chosen by the step's draw (`dpmem.data.users.Users.batch`): a
    (users, k) index, -1 in the empty slots."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate={sample_rate}: a probability, in (0, 1]")
    for _ in range(steps):
        rng = draws.numpy()
        chosen = np.flatnonzero(rng.random(len(users)) < sample_rate)
        yield users.batch(chosen, k, int(rng.integers(2 ** 63))).view(-1, k)


def make_batches(kind: str, n: int, batch_size: int, steps: int, draws: Draws, groups: int | None = None):
    if kind == "poisson":
        return poisson_batches(n, batch_size / n, steps, draws)
    if kind == "cyclic":
        if groups is None:
            raise ValueError("cyclic sampling needs its number of groups (a correlated strategy's)")
        return cyclic_batches(n, batch_size, groups, steps, draws)
    if kind not in ("fixed", "shuffle"):
        raise ValueError(f"sampling {kind!r}: allowed poisson, fixed, shuffle, cyclic")
    return (fixed_batches if kind == "fixed" else shuffled_batches)(n, batch_size, steps, draws)
