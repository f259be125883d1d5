"""The broken privatizers `dpmem audit` must catch. Issue 42's three are substitutions into the real code for as long
as their context lasts. `tests/test_audit.py` asserts it does, `scripts/audit_variants.py` measures how far.

- skip_real_clipping: clipping skipped on the real samples' path only (one pass: the micro-batch's weighted sum
  takes weight 1; two passes: every norm 0); the Privatizer's `clipped_sum_of`, which clips canaries planted in the
  sum, unchanged.
- noise_per_microbatch: noise of std σC/k added to each of a step's k micro-batches (in sum σC/√k), none once per
  step.
- norms_per_use: a weight used several times normed per use: ghost norms' ‖Σ_u g_u‖² taken as Σ_u ‖g_u‖² (the
  cross terms between uses dropped), so a sample whose uses agree is clipped as if √uses times smaller.

Issue 54's four are broken mechanisms (`NoiseCut`, `OneLayerClipping`) that a run uses in place of the calibrated
one: each function below returns a `mechanism_of(mechanism, model, canaries)` for `run_audit(..., mechanism_of=...)`:
- noise_cut_away_from(): noise of std σC/2 on every clipped sum that holds no canary;
- clipping_from(name): the clip factor from one parameter's norm (where the canaries lived before they were spread);
- noise_skipped_on(step): the noise left out of the release of one step (0-based) in the run, and only that one;
- noise_divided_by(4): DPZero's noise cut to a quarter."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from unittest import mock

import torch

import dpmem.methods.privatize as privatize
from dpmem.methods.privatize import Privatizer
from dpmem.persample import reducers
from dpmem.persample.factored import Factored
from dpmem.privacy.mechanism import GaussianMechanism


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
        if not isinstance(self.mechanism, NoiseCut):  # the step's own release adds none
            self.mechanism = NoiseCut(self.mechanism, math.inf)
        m, micro, total, loss_sum = self.mechanism, list(microbatches), {}, 0.0
        for mb in micro:
            summed, loss = accumulate(self, [mb], loss_fn, shapes, projections)
            GaussianMechanism(m.sigma / len(micro), m.max_grad_norm, 1.0, m.draws).release(summed)
            total = summed if not total else {p: total[p] + summed[p] for p in total}
            loss_sum = loss_sum + loss
        return total, loss_sum
    with mock.patch.object(Privatizer, "clip_and_accumulate", noised):
        yield


@contextlib.contextmanager
def norms_per_use():
    squared_norms = Factored.squared_norms

    def per_use(self):
        return torch.stack([squared_norms(Factored([t], self.rows, self.cols, self.param_shape))
                            for t in self.terms]).sum(0)
    with mock.patch.object(Factored, "squared_norms", per_use):
        yield


# -- broken mechanisms: each a GaussianMechanism that a run uses in place of the calibrated one ----------------
class BrokenMechanism(GaussianMechanism):
    """A mechanism with `base`'s σ, C, q·n, rate, draws and loss release, which a subclass breaks."""

    def __init__(self, base: GaussianMechanism):
        super().__init__(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})


class NoiseCut(BrokenMechanism):
    """Noise of std σC/`factor` (inf: none) on the clipped sums whose key `where(key)` accepts (every one when None:
    DPZero's scalar has key None), at the releases (0-based steps) in `at` (every one when None); σC elsewhere."""

    def __init__(self, base: GaussianMechanism, factor: float, where=None, at=None):
        super().__init__(base)
        self.factor, self.where, self.at = factor, where, at

    def noise_std(self, key) -> float:
        std = super().noise_std(key)
        cut = (self.where is None or self.where(key)) and (self.at is None or self.releases in self.at)
        return std / self.factor if cut else std


class OneLayerClipping(BrokenMechanism):
    """Clip factors from one parameter's per-sample norm alone (`layer`): every other parameter's gradient goes
    through unclipped (true ε ∞)."""

    def __init__(self, base: GaussianMechanism, layer):
        super().__init__(base)
        self.layer = layer

    def clip_factors(self, squares: dict) -> torch.Tensor:
        some = next(iter(squares.values()))
        return super().clip_factors({self.layer: squares.get(self.layer, torch.zeros_like(some))})


def noise_cut_away_from(factor: float = 2.0):
    """Noise σC/`factor` on every tensor that holds no canary (the canaries' own coordinates see the claimed noise);
    the first step's (where the canaries are placed) uncut."""
    return lambda mechanism, model, canaries: NoiseCut(
        mechanism, factor, where=lambda key: canaries.where is not None and key not in canaries.where)


def noise_skipped_on(step: int):
    """No noise on the release of `step` (0-based), and only that one."""
    return lambda mechanism, model, canaries: NoiseCut(mechanism, math.inf, at={step})


def noise_divided_by(factor: float):
    """Noise σC/`factor` on every release (DPZero's noise cut to a quarter with factor 4)."""
    return lambda mechanism, model, canaries: NoiseCut(mechanism, factor)


def clipping_from(name: str):
    """Clip factors from the per-sample norm of the model's parameter `name` alone."""
    return lambda mechanism, model, canaries: OneLayerClipping(mechanism, model.get_parameter(name))
