"""Samplers that draw the example indices of each logical step, matching what the accountant assumes."""

from __future__ import annotations

from typing import Iterator

import torch


def poisson_batches(n: int, sample_rate: float, steps: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Each example joins each step independently with probability `sample_rate` (batch sizes vary, may be 0)."""
    for _ in range(steps):
        yield torch.nonzero(torch.rand(n, generator=generator) < sample_rate).flatten()


def fixed_batches(n: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """`batch_size` examples drawn uniformly without replacement, independently at every step."""
    for _ in range(steps):
        yield torch.randperm(n, generator=generator)[:batch_size]


def shuffled_batches(n: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Epochs of shuffled fixed-size batches (the last one of an epoch may be smaller). Non-private only."""
    done = 0
    while True:
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            if done == steps:
                return
            yield perm[start:start + batch_size]
            done += 1


def make_batches(kind: str, n: int, batch_size: int, steps: int, generator: torch.Generator):
    if kind == "poisson":
        return poisson_batches(n, batch_size / n, steps, generator)
    if kind == "fixed":
        return fixed_batches(n, batch_size, steps, generator)
    if kind == "shuffle":
        return shuffled_batches(n, batch_size, steps, generator)
    raise ValueError(f"sampling {kind!r}: allowed poisson, fixed, shuffle")
