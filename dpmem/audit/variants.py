"""The broken privatizers `dpmem audit` must catch, each a mechanism (or its clipping plan) that a run uses in place
of the calibrated one: each function below returns a `mechanism_of(mechanism, model, canaries)` for
`run_audit(..., mechanism_of=...)` (and tests/test_audit.py's `privatizer_audit`). `tests/test_audit.py` asserts the
audit catches each, `scripts/audit_variants.py` measures how far. Issue 42's three: skip_real_clipping(),
noise_per_microbatch(), norms_per_use(); issue 54's four: noise_cut_away_from(), clipping_from(name),
noise_skipped_on(step), noise_divided_by(4); issue 65's three, in the noise's correlation across steps:
noise_reused_on(step), buffers_dropped(), band_halved(band); issue 66's, in the privacy unit:
records_clipped_alone()."""

from __future__ import annotations

import dataclasses
import math

import torch

from dpmem.methods.privatize import Observer
from dpmem.persample.factored import Factored
from dpmem.persample.norms import exact_squared_norms
from dpmem.privacy.correlated import CorrelatedNoise
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.strategies import make_strategy


class BrokenMechanism(GaussianMechanism):
    """`base` itself (σ, C, q·n, draws, loss release, observers, plan, accounting: one state), which a subclass
    breaks; `fields` are the subclass's own settings."""

    __setattr__ = object.__setattr__  # a run's mechanism may be a frozen description; a broken one keeps step state

    def __init__(self, base: GaussianMechanism, **fields):
        self.__dict__.update(base.__dict__, **fields)


class NoiseCut(BrokenMechanism):
    """Noise of std σC/`factor` (inf: none) on the clipped sums whose key `where(key)` accepts (every one when None:
    DPZero's scalar has key None), at the releases (0-based steps) in `at` (every one when None); σC elsewhere."""

    factor, where, at = 1.0, None, None

    def noise_std(self, key) -> float:
        std = super().noise_std(key)
        cut = (self.where is None or self.where(key)) and (self.at is None or self.releases in self.at)
        return std / self.factor if cut else std


class OneLayerClipping(BrokenMechanism):
    """Clip factors from one parameter's per-sample norm alone (`layer`; where the canaries lived before they were
    spread): every other parameter's gradient goes through unclipped (true ε ∞)."""

    layer = None

    def clip_factors(self, squares: dict) -> torch.Tensor:
        some = next(iter(squares.values()))
        return super().clip_factors({self.layer: squares.get(self.layer, torch.zeros_like(some))})


def records_clipped_alone():
    """Each record clipped on its own where the run claims a user's ε (ULS: privacy.unit=user): a user of k records
    moves the clipped sum by k·C, not C (true ε that of sensitivity k)."""
    return lambda mechanism, model, canaries: dataclasses.replace(mechanism, per_user=False)


def noise_cut_away_from(factor: float = 2.0):
    """Noise σC/`factor` on every tensor that holds no canary (the canaries' own coordinates see the claimed noise);
    the first step's (where the canaries are placed) uncut."""
    return lambda mechanism, model, canaries: NoiseCut(
        mechanism, factor=factor, where=lambda key: canaries.where is not None and key not in canaries.where)


def noise_skipped_on(step: int):
    """No noise on the release of `step` (0-based) in the run, and only that one."""
    return lambda mechanism, model, canaries: NoiseCut(mechanism, factor=math.inf, at={step})


def noise_divided_by(factor: float):
    """Noise σC/`factor` on every release (DPZero's noise cut to a quarter with factor 4)."""
    return lambda mechanism, model, canaries: NoiseCut(mechanism, factor=factor)


def clipping_from(name: str):
    """Clip factors from the per-sample norm of the model's parameter `name` alone."""
    return lambda mechanism, model, canaries: OneLayerClipping(mechanism, layer=model.get_parameter(name))


class SkippedClipping(BrokenMechanism, Observer):
    """Clip factors of 1 from a step's start until its clipped sums are complete: its micro-batches go unclipped
    (the real samples', and batch canaries' that join them); what is clipped after them (the canaries planted in the
    sum, `Privatizer.clipped_sum_of`) is clipped. It observes the step itself, first."""

    def __init__(self, base: GaussianMechanism):
        super().__init__(base, skipping=False)
        self.observers = (self, *self.observers)

    def clip_factors(self, squares: dict) -> torch.Tensor:
        factors = super().clip_factors(squares)
        return torch.ones_like(factors) if self.skipping else factors

    def on_microbatches(self, privatizer, microbatches, loss_fn):
        self.skipping = True
        return microbatches, loss_fn

    def on_clipped(self, privatizer, summed):
        self.skipping = False
        return summed


class NoisePerMicrobatch(BrokenMechanism, Observer):
    """Noise σC/k on each of a step's k micro-batches, none once per step: σC/√k at the release, which draws it at
    once (k draws of std σC/k add up to one of σC/√k). It observes the step itself, last, to count the micro-batches
    (so batch canaries' micro-batch counts)."""

    def __init__(self, base: GaussianMechanism):
        super().__init__(base, microbatches=1)
        self.observers = (*self.observers, self)

    def noise_std(self, key) -> float:
        return super().noise_std(key) / math.sqrt(max(self.microbatches, 1))

    def on_microbatches(self, privatizer, microbatches, loss_fn):
        microbatches = list(microbatches)
        self.microbatches = len(microbatches)
        return microbatches, loss_fn


def per_use_norms(g) -> torch.Tensor:
    """Σ_u ‖g_u‖² over a factored gradient's uses (its terms), each normed alone (ghost): the cross terms dropped.
    A dense gradient is normed exactly."""
    if not isinstance(g, Factored):
        return exact_squared_norms(g)
    return torch.stack([Factored([t], g.rows, g.cols, g.param_shape).squared_norms() for t in g.terms]).sum(0)


def skip_real_clipping():
    """`SkippedClipping`: the step's micro-batches unclipped; the canaries planted in the sum clipped."""
    return lambda mechanism, model, canaries: SkippedClipping(mechanism)


def noise_per_microbatch():
    """Noise σC/k on each of a step's k micro-batches instead of σC once."""
    return lambda mechanism, model, canaries: NoisePerMicrobatch(mechanism)


def norms_per_use():
    """The mechanism's plan with every factored gradient normed per use (`per_use_norms`), so that a sample whose
    uses agree is clipped as if √uses times smaller."""
    return norms_by(per_use_norms)


def norms_by(rule):
    """The mechanism's plan with its norm rule replaced by `rule`, a function of a per-sample gradient."""
    return lambda mechanism, model, canaries: BrokenMechanism(
        mechanism, plan=dataclasses.replace(mechanism.plan, norms=rule))


class ReusedNoise:
    """The noise of release `step` (0-based) carried again by release `step + 1`, a `NoiseSwapped` source (what the
    mechanism asks of it: `noise(run, shape, device, dtype)` and `advance()`): the two releases' difference is the
    clipped sums' alone, noise-free (true ε ∞). `base` draws every release's noise as the mechanism would, and moves
    on as usual."""

    def __init__(self, base, step: int):
        self.base, self.step, self.index, self.kept = base, step, 0, {}

    def noise(self, run: str, shape: tuple, device, dtype) -> torch.Tensor:
        w = self.base.noise(run, shape, device, dtype)
        if self.index == self.step:  # a noise vector is kept, not changed, by whoever draws it (bandmf keeps it)
            self.kept[run] = w
        return self.kept.pop(run) if self.index == self.step + 1 else w

    def advance(self) -> None:
        self.index += 1
        self.base.advance()

    def __getattr__(self, name: str):
        """What else the run asks of its noise (its memory meter: `tensors()`, `buffers`) is `base`'s."""
        return getattr(self.__dict__["base"], name)


class NoiseSwapped(BrokenMechanism):
    """Each release's noise drawn by `source` in place of the mechanism's own correlated noise (`correlated`: what
    the mechanism asks for a release's noise, and moves on, whatever its strategy; None: fresh keyed draws)."""

    source = None
    correlated = property(lambda self: self.source)


def noise_reused_on(step: int):
    """Release `step + 1` (0-based) carries release `step`'s noise draw again. Independent noise (the mechanism has
    no `correlated`) is drawn fresh from torch's generator here, as a mechanism without keys draws it: the keyed
    draws are the mechanism's own."""
    return lambda mechanism, model, canaries: NoiseSwapped(mechanism, source=ReusedNoise(
        mechanism.correlated or CorrelatedNoise(make_strategy("independent", 1, 1), None), step))


def strategy_changed(change):
    """The noise drawn with the strategy `change(claimed)` from the claimed one's keys (the same z), while the run
    claims, and accounts, the strategy it was given: the audit un-correlates by the claimed C."""
    def mechanism_of(mechanism, model, canaries):
        noise = mechanism.correlated
        if noise is None:
            raise ValueError("a changed strategy needs a correlated one to change (privacy.noise=bandmf|bisr)")
        return NoiseSwapped(mechanism, source=CorrelatedNoise(change(noise.strategy), noise.key, noise.restart))
    return mechanism_of


def buffers_dropped():
    """bandmf without its b − 1 buffers: each release's noise σz/c_0, the fresh draw over C's first coefficient
    (variance σ²/c_0² where the claim's is σ²Σ_j (C⁻¹)²_ij, and no correlation across steps)."""
    return strategy_changed(lambda s: dataclasses.replace(s, bands=1, coefs=s.coefs[:1]))


def band_halved(band: int):
    """The strategy's coefficient of `band` (0 < band < b; C's for bandmf) halved: C⁻¹ is another matrix's."""
    def change(s):
        if not 0 < band < s.bands:
            raise ValueError(f"band {band}: allowed 1 to {s.bands - 1} (the strategy's bands less its first)")
        return dataclasses.replace(s, coefs=tuple(c / 2 if j == band else c for j, c in enumerate(s.coefs)))
    return strategy_changed(change)
