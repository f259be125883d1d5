"""The Gaussian mechanism of every first-order private method (flat clipping: DP-GRAPE (arXiv 2506.15588) Algorithm 3):

    G̃ = ( Σᵢ min(1, C/‖gᵢ‖)·gᵢ + N(0, σ²C² I) ) / (q·n)

where gᵢ is sample i's gradient over all trainable parameters (projected ones as DP-GRAPE projects them).
Clipped sums accumulate over physical micro-batches; the noise is drawn once per logical step.

`clipping` says how Σᵢ min(1, C/‖gᵢ‖)·gᵢ is formed:
- materialize: one backward pass keeps every parameter's per-sample gradients, then norms and the weighted sum;
- bk (book-keeping, Bu et al. ICML 2023): one backward pass keeps each linear-like layer's factors (its input A
  and output gradient G; dense per-sample gradients of the rest), exact norms from them (T×T Gram matrices or
  the layer's per-sample products, whichever is smaller), then the clipped sum (c ⊙ G)ᵀA per layer;
- fgc | ghost | mixed | hutch | hutchpp: two passes (Opacus' fast gradient clipping). The first backward keeps
  only per-sample squared norms, one layer at a time (`dpmem.persample.norms` says how each rule gets them);
  the second back-propagates Σᵢ min(1, C/‖gᵢ‖)·Lᵢ through the same graph, so autograd itself sums the clipped
  gradients into `.grad`. With an estimator (DP-SGD-RC) ‖gᵢ‖ is the square root of the summed estimates.
  `bookkeeping=True` takes an estimator's norms in bk's one pass instead: the same clip factors, hence the same
  mechanism, with the clipped sums formed from the kept factors.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from dpmem import distributed, sharding
from dpmem.metering import memory_label
from dpmem.methods.base import Noise, batch_size
from dpmem.persample import (PerSampleGradients, Projection, clip_factors, reducers, verify_coverage, weighted_sum,
                             weighted_sum_of)
from dpmem.persample.hooks import remove_handles, weakly
from dpmem.persample.norms import ESTIMATORS, RULES
from dpmem.precision import exact_float32

CLIPPINGS = ("materialize", "bk") + RULES


class Privatizer:
    """The privatised gradient of `model`'s trainable parameters, one logical step per call.

    Its hooks (the per-sample capture's, and one per parameter that drops autograd's batch gradient) are removed
    by `close()` (or `with Privatizer(...) as privatize:`) and when it is garbage-collected. They act only inside
    its own call, so several privatizers on one model, or a plain `loss.backward()` beside one, do not interfere.
    """

    def __init__(self, model: nn.Module, noise: Noise, check_coverage: bool = True, clipping: str = "materialize",
                 k: int = 32, bookkeeping: bool = False):
        if clipping not in CLIPPINGS:
            raise ValueError(f"clipping {clipping!r}: allowed {', '.join(CLIPPINGS)}")
        if bookkeeping and clipping not in ESTIMATORS:
            raise ValueError(f"bookkeeping with an estimator ({', '.join(ESTIMATORS)}), not {clipping!r}; "
                             "exact norms have clipping='bk'")
        self.model, self.noise, self.clipping, self.k = model, noise, clipping, k
        # one backward pass (materialize, book-keeping): the rule that norms the kept per-sample gradients (exact for
        # dense ones, ghost for an embedding's, mixed for factors, or an estimator); None: two passes
        self._one_pass_norms = {"materialize": "ghost", "bk": "mixed"}.get(clipping, clipping if bookkeeping else None)
        self.persample = PerSampleGradients(model)
        self.params = self.persample.parameters
        self.device = self.params[0].device
        self._check_coverage = check_coverage
        self.sharded = any(sharding.is_sharded(p) for p in self.params)  # FSDP (dpmem.sharding)
        # Seeds drawn once per logical step, the same on every rank, from a CPU generator (no host sync per step)
        # seeded by the noise generator:
        # - the estimators' probes (dp-sgd-rc), shared by the step's whole batch: every micro-batch, on every rank,
        #   draws them again from the step's seed, so neither the physical batch size nor the number of ranks
        #   changes them, and the noise generator draws the same on all ranks;
        # - under FSDP, each rank's generator of the step's noise on its shards (seeded by the step's seed and rank).
        self.step_seeds = self._probe_draws = None
        if noise.generator is not None and (clipping in ESTIMATORS or self.sharded):
            seed = int(torch.randint(2**62, (1,), generator=noise.generator, device=noise.generator.device))
            self.step_seeds = torch.Generator().manual_seed(seed)
        if self.step_seeds is not None and clipping in ESTIMATORS:
            self._probe_draws = torch.Generator(device=noise.generator.device)
        self._keep_grads = False  # the second pass of two-pass clipping accumulates into .grad
        self._stepping = False  # inside __call__: the only time its hooks act
        # Called with the clipped sums (before noise) and the expected batch size that turns them into a mean.
        # The tensors are the ones the noise is then added to in place: an observer that keeps them must copy.
        self.observe: Callable[[dict[nn.Parameter, torch.Tensor], float], None] | None = None
        self.subspace = None  # dpmem.methods.subspace.SubspaceProjection, for subspace re-training
        self.canaries = None  # dpmem.audit.canaries.GradientCanaries, for dpmem audit
        # autograd's batch gradient is a by-product of the backward pass: drop each as soon as it is made
        drop = weakly(self._drop_grad)
        self._handles = [p.register_post_accumulate_grad_hook(drop) for p in self.params]
        self._close = weakref.finalize(self, remove_handles, self._handles)
        if self.sharded:
            # FSDP: a layer computes with gathered stand-ins of its parameters, and autograd's batch gradient lands
            # on those; dropped there before FSDP reduce-scatters what it finds, it costs no communication
            self._stand_ins: dict[int, torch.Tensor] = {}  # by id (tensors compare elementwise); FSDP keeps them
            watch = weakly(self._watch_stand_ins)
            self._handles += [m.register_forward_pre_hook(watch) for m in model.modules()
                              if any(p.requires_grad for p in m.parameters(recurse=False))]

    def _watch_stand_ins(self, module: nn.Module, args) -> None:
        for q in module.parameters(recurse=False):
            if q.requires_grad and not sharding.is_sharded(q) and id(q) not in self._stand_ins:
                self._stand_ins[id(q)] = q
                self._handles.append(q.register_post_accumulate_grad_hook(weakly(self._drop_grad)))

    def close(self) -> None:
        """Remove every hook it put on the model (idempotent)."""
        self._close()
        self.persample.close()

    def __enter__(self) -> "Privatizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drop_grad(self, p: nn.Parameter) -> None:
        if self._stepping and not self._check_coverage and not self._keep_grads:
            p.grad = None

    def __call__(self, microbatches, loss_fn, shapes: dict[nn.Parameter, torch.Size],
                 projections: dict[nn.Parameter, Callable[[], Projection]] | None = None
                 ) -> tuple[dict[nn.Parameter, torch.Tensor], torch.Tensor]:
        """The privatised gradient (of shape `shapes[p]` per parameter) and the summed per-sample loss.
        `projections` (DP-GRAPE, one pass only) makes a parameter's projection when its layer's gradient arrives;
        its per-sample gradients, clipped sum and noise are then projected ones."""
        if projections and self._one_pass_norms is None:
            raise ValueError(f"projected per-sample gradients need one-pass clipping, not {self.clipping!r}")
        self._stepping = True
        try:
            if self._one_pass_norms is not None:
                summed, loss_sum = self._one_pass(microbatches, loss_fn, shapes, projections or {})
            else:
                summed, loss_sum = self._two_pass(microbatches, loss_fn)
        finally:
            self._stepping = False
        with exact_float32(self.device):
            return self._noised(summed), loss_sum

    def _noised(self, summed: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        # the clipped sums of the whole logical batch, on every rank (FSDP's shards are reduced already)
        distributed.sum_(s for s in summed.values() if not sharding.is_sharded(s))
        if self.observe is not None:  # e.g. dpmem spectrum's recorder of the non-noised clipped mean
            self.observe(summed, self.noise.expected_batch_size)
        if self.canaries is not None:  # planted gradients, clipped as the real ones are, summed before the noise
            self.canaries.plant(summed, self._clipped_sum)
        if self.subspace is not None and self.subspace.where == "clipped":
            summed = self.subspace(summed)
        summed = add_noise(summed, self.noise, self._shard_noise() if self.sharded else None)
        if self.subspace is not None and self.subspace.where == "privatised":
            summed = self.subspace(summed)
        if self.canaries is not None:
            self.canaries.record(summed)
        return summed

    def _clipped_sum(self, grads: dict) -> dict:
        """Σᵢ min(1, C/‖gᵢ‖)·gᵢ of per-sample gradients given outside a backward pass (dpmem audit's canaries:
        `Factored` or dense rows, keyed like the clipped sums), through the real samples' code: the method's norm
        rule and reducer, the clip factors, the weighted sum. A fault there shows in the audit."""
        reduce = self._reducer() if self._one_pass_norms is not None else reducers.with_kept(
            reducers.norms(self.clipping, self.k, self._probe_draws))
        reduced = {key: reduce(g) for key, g in grads.items()}
        factors = clip_factors(sum(squares for squares, _ in reduced.values()).sqrt(), self.noise.max_grad_norm)
        return {key: weighted_sum_of(kept, factors) for key, (_, kept) in reduced.items()}

    def _reducer(self):
        """One-pass clipping's reducer: squared norms by the method's rule, and the per-sample gradients kept for
        the clipped sum (dense for materialize, factors for book-keeping)."""
        dense = self.clipping == "materialize"
        return reducers.normed(self._one_pass_norms, self.k, self._probe_draws,
                               **({"then": reducers.materialize} if dense else {}))

    def _step_seed(self) -> int:
        return int(torch.randint(2**62, (1,), generator=self.step_seeds))

    def _shard_noise(self) -> torch.Generator | None:
        """This rank's generator of the step's noise on its FSDP shards (None on meta, where nothing is drawn)."""
        if self.step_seeds is None:
            return None
        seed = (self._step_seed() + 1_000_003 * distributed.rank()) % 2**63
        return torch.Generator(device=self.noise.generator.device).manual_seed(seed)

    def _with_step_probes(self, microbatches):
        """The micro-batches, with dp-sgd-rc's probe generator reset to the step's seed before each: the step's
        probes, the same for every micro-batch (and rank)."""
        seed = self._step_seed() if self._probe_draws is not None else None
        for mb in microbatches:
            if seed is not None:
                self._probe_draws.manual_seed(seed)
            yield mb

    def _one_pass(self, microbatches, loss_fn, shapes, projections):
        summed = {}  # made by the first micro-batch's clipped sums, after its backward pass (`_accumulate`)
        loss_sum = torch.zeros((), device=self.device)
        keep = self._reducer()  # materialize: dense per-sample gradients; book-keeping: the factors
        reduce = {p: reducers.projected(projections[p], keep) if p in projections else keep for p in self.params}
        for mb in self._with_step_probes(microbatches):
            # autograd's batch gradient is needed only by the coverage check: otherwise the hooks' per-sample
            # gradients are all there is, and the backward skips the weights' batch products
            with self.persample.capture(batch_size(mb), reduce, batch_gradients=self._check_coverage) as kept:
                losses = loss_fn(self.model, mb)
                losses.sum().backward()
            with exact_float32(self.device):
                # squared norms, made as each layer's gradient arrived, and its per-sample gradients
                norms = sum(squares for squares, _ in kept.values()).sqrt()
                grads = {p: g for p, (_, g) in kept.items()}
                del kept
                if self._check_coverage:
                    self._check_coverage = False
                    ones = torch.ones(batch_size(mb), device=self.device)
                    verify_coverage(self.model, self.params, weighted_sum(grads, ones),
                                    lambda p, g: projections[p]().project(g) if p in projections else g,
                                    self.persample.compute)
                factors = clip_factors(norms, self.noise.max_grad_norm) * sharding.weight(mb)
                for p, g in grads.items():  # one parameter at a time: no second model-sized temporary
                    with memory_label("gradients"):
                        _accumulate(summed, p, weighted_sum_of(g, factors))
                del grads
            loss_sum = loss_sum + losses.detach().sum() * sharding.weight(mb)
        return self._completed(summed, shapes), loss_sum

    def _two_pass(self, microbatches, loss_fn):
        summed = {}  # the first micro-batch's .grad tensors themselves (`_accumulate`)
        loss_sum = torch.zeros((), device=self.device)
        norm = reducers.norms(self.clipping, self.k, self._probe_draws)
        for mb in self._with_step_probes(microbatches):
            check = self._check_coverage
            reduce = dict.fromkeys(self.params, reducers.with_sum(norm) if check else norm)
            with self.persample.capture(batch_size(mb), reduce) as kept:
                losses = loss_fn(self.model, mb)
                losses.sum().backward(retain_graph=True)  # first pass: norms only
            with exact_float32(self.device):
                if check:
                    self._check_coverage = False
                    verify_coverage(self.model, self.params, {p: total for p, (_, total) in kept.items()},
                                    compute=self.persample.compute)
                    kept = {p: squares for p, (squares, _) in kept.items()}
                factors = clip_factors(sum(kept.values()).sqrt(), self.noise.max_grad_norm) * sharding.weight(mb)
            self._keep_grads = True
            try:  # second pass: autograd forms Σᵢ fᵢ gᵢ in .grad, in the model's own precision
                wide = torch.promote_types(losses.dtype, factors.dtype)  # a bf16 loss is weighed in float32
                (losses.to(wide) * factors.to(wide)).sum().backward()
            finally:
                self._keep_grads = False
            for p in self.params:  # out of .grad before the next first pass drops it
                if p.grad is not None:
                    _accumulate(summed, p, p.grad)
                    p.grad = None
            loss_sum = loss_sum + losses.detach().sum() * sharding.weight(mb)
        return self._completed(summed), loss_sum

    def _completed(self, summed, shapes=None) -> dict[nn.Parameter, torch.Tensor]:
        """Every parameter's clipped sum: zeros (of `shapes[p]`, else of p: a shard under FSDP) for one that no
        micro-batch reached."""
        with memory_label("gradients"):
            return {p: summed[p] if p in summed else
                    torch.zeros_like(p) if shapes is None else torch.zeros(shapes[p], device=p.device, dtype=p.dtype)
                    for p in self.params}


def _accumulate(summed: dict, p: nn.Parameter, part: torch.Tensor) -> None:
    """The first micro-batch's part becomes the sum itself (no zeroed model-sized buffer beside it); later ones
    are added in place."""
    summed[p] = part if p not in summed else summed[p].add_(part)


def add_noise(summed: dict[nn.Parameter, torch.Tensor], noise: Noise,
              own: torch.Generator | None = None) -> dict[nn.Parameter, torch.Tensor]:
    """The Gaussian mechanism on clipped sums, in place: (Σᵢ clip(gᵢ) + N(0, σ²C² I)) / (q·n).

    A sum every rank holds whole gets the same draw on every rank (the generator has one seed). A sum sharded by
    FSDP gets, on each rank, a draw for its own shard from `own`, that rank's generator of the step."""
    std = noise.sigma * noise.max_grad_norm
    for p, s in summed.items():
        part = sharding.local(s)
        if std > 0:  # sigma = 0 only for privacy=none: clipping without noise
            generator = own if part is not s and own is not None else noise.generator
            part += std * torch.randn(part.shape, generator=generator, device=part.device, dtype=part.dtype)
        part /= noise.expected_batch_size
    return summed
