"""The harness of the benchmarks that train many `dpmem train` runs side by side (bench_correlated.py,
bench_user_level.py): a configuration composed once per setting and copied for each run, and a pool of spawned
processes, one run each, that share the cores. Composed, not validated: a record-level run of data
that names its users (the user-level benchmark's baseline) is what `dpmem train` refuses and these pages compare."""

from __future__ import annotations

import copy
import functools
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
from hydra import compose

from dpmem.composition import initialized


def config(overrides):
    """The composed configuration, a copy of its own (a run may change it)."""
    return copy.deepcopy(_composed(tuple(overrides)))


@functools.cache  # one composition per setting: a benchmark asks for each many times, and Hydra takes ~0.3 s
def _composed(overrides: tuple[str, ...]):
    with initialized():
        return compose("config", overrides=list(overrides))


def start_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def pool_map(fn, items: list, jobs: int) -> list:
    """fn over items, in this process (jobs = 1) or in `jobs` spawned processes that split the cores (each run
    alone, so that runs on 2 cores go two at a time)."""
    if jobs == 1:
        return [fn(item) for item in items]
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn"), initializer=start_worker,
                             initargs=(threads,)) as pool:
        return list(pool.map(fn, items))
