"""Issue 42's three broken privatizers, each a substitution into the real code for as long as its context lasts:
what `dpmem audit` must catch. `tests/test_audit.py` asserts it does, `scripts/audit_variants.py` measures how far.

- skip_real_clipping: clipping skipped on the real samples' path only (one pass: the micro-batch's weighted sum
  takes weight 1; two passes: every norm 0); the Privatizer's `clipped_sum_of`, which clips canaries planted in the
  sum, unchanged.
- noise_per_microbatch: noise of std σC/k added to each of a step's k micro-batches (in sum σC/√k), none once per
  step.
- norms_per_use: a weight used several times normed per use: ghost norms' ‖Σ_u g_u‖² taken as Σ_u ‖g_u‖² (the
  cross terms between uses dropped), so a sample whose uses agree is clipped as if √uses times smaller.
- noise_cut_away_from(kept): noise of std σC/2 on every clipped sum but those of the parameters `kept(p)` accepts
  (where the canaries live): the canaries' own coordinates see the claimed noise.
- noise_skipped_on(step): the noise left out of the release of one step (0-based) in the run, and only that one."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch

import dpmem.methods.privatize as privatize
from dpmem.methods.privatize import Privatizer
from dpmem.persample import reducers
from dpmem.persample.factored import Factored


@contextlib.contextmanager
def skip_real_clipping():
    weighted_sums = privatize.weighted_sums
    with mock.patch.object(privatize, "weighted_sums", lambda grads, f: weighted_sums(grads, torch.ones_like(f))), \
            mock.patch.object(reducers, "norms", lambda *args, **kwargs: lambda g: torch.zeros(g.shape[0])):
        yield


@contextlib.contextmanager
def noise_per_microbatch():
    accumulate = Privatizer.clip_and_accumulate

    def noised(self, microbatches, loss_fn, shapes, projections=None):
        micro, total, loss_sum = list(microbatches), {}, 0.0
        for mb in micro:
            summed, loss = accumulate(self, [mb], loss_fn, shapes, projections)
            privatize.add_noise(summed, dataclasses.replace(self.noise, sigma=self.noise.sigma / len(micro)))
            total = summed if not total else {p: total[p] + summed[p] for p in total}
            loss_sum = loss_sum + loss
        return total, loss_sum
    with mock.patch.object(Privatizer, "clip_and_accumulate", noised), \
            mock.patch.object(Privatizer, "add_noise", lambda self, summed: summed):
        yield


@contextlib.contextmanager
def noise_cut_away_from(kept):
    add_noise = privatize.add_noise

    def cut(summed, noise, *shards):
        half = dataclasses.replace(noise, sigma=noise.sigma / 2)
        add_noise({p: s for p, s in summed.items() if kept(p)}, noise, *shards)
        add_noise({p: s for p, s in summed.items() if not kept(p)}, half, *shards)
        return summed
    with mock.patch.object(privatize, "add_noise", cut):
        yield


@contextlib.contextmanager
def noise_skipped_on(step: int):
    add_noise, calls = privatize.add_noise, []

    def skipped(summed, noise, *shards):
        calls.append(1)
        return summed if len(calls) == step + 1 else add_noise(summed, noise, *shards)
    with mock.patch.object(privatize, "add_noise", skipped):
        yield


@contextlib.contextmanager
def norms_per_use():
    squared_norms = Factored.squared_norms

    def per_use(self):
        return torch.stack([squared_norms(Factored([t], self.rows, self.cols, self.param_shape))
                            for t in self.terms]).sum(0)
    with mock.patch.object(Factored, "squared_norms", per_use):
        yield
