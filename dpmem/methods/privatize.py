"""The private step of every first-order private method (flat clipping: DP-GRAPE (arXiv 2506.15588) Algorithm 3):

    G̃ = ( Σᵢ min(1, C/‖gᵢ‖)·gᵢ + N(0, σ²C² I) ) / (q·n)

where gᵢ is sample i's gradient over all trainable parameters (projected ones as DP-GRAPE projects them), in
named stages as Opacus names them: clip and accumulate (over physical micro-batches; `dpmem.methods.clipping_plan`
says how), sum over ranks, release: noise drawn once per logical step, scaled by 1/(q·n) (`dpmem.privacy.mechanism`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, NoReturn

import torch
from torch import nn

from dpmem import distributed, sharding
from dpmem.metering import memory_label
from dpmem.methods.base import batch_size
from dpmem.methods.clipped_unit import ClippedUnit
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.compiled_step import CompiledStep
from dpmem.methods.attribution import public_weights, rows_misread, used_outside, verify_attribution, where_samples_mix
from dpmem.models import checkpointed
from dpmem.persample import Projection, reducers, weighted_sum
from dpmem.persample.clipping import grouped_squares, weighted_sums
from dpmem.persample.fallback import freeze_fix
from dpmem.persample.taps import RepeatedUse, Taps
from dpmem.precision import exact_float32
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, Drawn, Recorded, rewound


class Observer:
    """Sees, and may replace, a private step's quantities; it hangs on the mechanism (`GaussianMechanism.observers`).
    `on_clipped` gets the clipped sums of the whole logical batch (over every rank) before the noise, `on_noised`
    the privatised gradient. Observers are called in their list's order before the noise and in the reverse order
    after it, so the first one sees the rawest sums and the final release. A tensor they keep must be copied: the
    noise is then added in place."""

    def attach(self, privatizer: "Privatizer") -> None:
        """Called once, when the privatizer is made (its model and parameters are known then)."""

    def on_microbatches(self, privatizer: "Privatizer", microbatches, loss_fn):
        """The step's micro-batches and per-sample loss before any of them runs; returns those to run in their place
        (dpmem audit's canaries join the micro-batches as samples of their own, through the real samples' path)."""
        return microbatches, loss_fn

    def on_accumulated(self, privatizer: "Privatizer", summed: dict, index: int) -> None:
        """After micro-batch `index` (0-based) of this rank's step: `summed` holds the clipped sums so far (a
        parameter no micro-batch reached yet is missing). dpmem audit's canaries read the real samples' part there,
        before their own micro-batch, the last."""

    def on_clipped(self, privatizer: "Privatizer", summed: dict) -> dict:
        return summed

    def on_noised(self, privatizer: "Privatizer", released: dict) -> dict:
        return released


class PrivateGradient(NamedTuple):
    """What `Privatizer.gradient` returns: (gradient, loss_sum)."""
    gradient: dict  # parameter -> its privatised gradient (shaped as asked: a projection for DP-GRAPE)
    # this rank's summed per-sample loss (on the device: no host sync), as the noise releases it: each loss
    # clipped to [0, L], and noised on rank 0, where the training loss is released privately (`GaussianMechanism`)
    loss_sum: torch.Tensor


def per_sample(losses: torch.Tensor, mb) -> torch.Tensor:
    """`losses`, refused unless one value per sample of `mb`: a batch's mean or sum would be clipped as one sample's
    loss, and one record would move the clipped sum by more than C. Losses that mix samples (a batch mean broadcast
    in) pass here; the attribution proof refuses them (`dpmem.methods.attribution`)."""
    if losses.shape != (batch_size(mb),):
        raise ValueError(f"the loss function returned shape {tuple(losses.shape)} for a micro-batch of "
                         f"{batch_size(mb)}: it must return one loss per sample, shape ({batch_size(mb)},), each "
                         "depending on its own sample alone (e.g. F.cross_entropy(..., reduction='none'))")
    return losses


class Privatizer:
    """The privatised gradient of `model`'s trainable parameters, one logical step per call. Its taps
    (`dpmem.persample.taps`) act only inside its own call and are removed by `close()` (or `with`).

    Args:
        model: the model whose trainable parameters (`requires_grad=True`) are privatised; a layer no per-sample
            rule covers is refused.
        mechanism: the Gaussian mechanism: clip factors from norms, and the release of the clipped sums.
        plan: how each sample's gradient is clipped (`ClippingPlan.of("bk")`: book-keeping, dp-adam's default;
            materialize keeps every per-sample gradient, the most memory).
        check_coverage: prove, on the first micro-batch and on any whose layers are read per sample differently
            (`Tape.layouts`), that each per-sample gradient is its own sample's (`dpmem.methods.attribution`), before
            anything is released.
    """

    def __init__(self, model: nn.Module, mechanism: GaussianMechanism,
                 plan: ClippingPlan = ClippingPlan.of("materialize"), check_coverage: bool = True):
        self.model, self.mechanism, self.plan, self.observers = model, mechanism, plan, tuple(mechanism.observers)
        self.sharded = any(sharding.is_sharded(p) for p in model.parameters() if p.requires_grad)  # FSDP
        self.taps = Taps(model, (lambda q: sharding.full(q).detach()) if self.sharded else None, checkpointed(model))
        self.params = self.taps.parameters
        if not self.params:
            raise ValueError("the model has no trainable parameter (every one has requires_grad=False): nothing to "
                             "privatise")
        self.device = self.params[0].device
        self.closed = False  # `close` removed the taps: a step then would clip nothing
        self._check_coverage = check_coverage  # the next micro-batch proves attribution
        # the layer layouts (`Tape.layouts`) proved so far; None: no proofs (check_coverage false). Under FSDP only the
        # first micro-batch proves (its check's backward pass is a collective, which ranks must take together)
        self._proven: set | None = set() if check_coverage and not self.sharded else None
        self._ambiguous: dict = {}  # the last recorded forward's layers that read both ways (`Tape.ambiguous`)
        self._zero = self.taps.zero()  # the probes' leaf (`Taps.zero`)
        self.compiled = CompiledStep()  # what `compile` compiled, and its state between steps
        # The mechanism's step keys (`MechanismState.steps`), where the step draws any: dp-sgd-rc's probes (each
        # micro-batch, on each rank, draws them again from the step's key, so neither the physical batch size nor
        # the number of ranks changes them) and, under FSDP, each rank's noise on its shards.
        self.step_keys = self._probe_draws = None
        draws = mechanism.state.noise
        if draws is not None and (plan.estimated or self.sharded):
            self.step_keys = mechanism.state.steps
        if self.step_keys is not None and plan.estimated:
            self._probe_draws = Draws(draws.key, "probes", draws.device)
        for observer in self.observers:
            observer.attach(self)

    def compile(self, compiler) -> None:
        """train.compile: each micro-batch compiled whole (`dpmem.compiling`), the release eager on its flat sum,
        after an eager rehearsal that releases nothing (the attribution proof: `_rehearse`); a checkpointed model's
        forward, or a TF32 run's, compiled alone with its taps, the rest eager (docs/methods.md, A compiled step,
        says why)."""
        if self.sharded or self.observers:
            raise ValueError("a compiled private step needs no FSDP and no observers (dpmem audit)")
        if checkpointed(self.model) or compiler.tf32:
            self.compiled.forward = compiler(self._forward, "forward")
            self.compiled.streamed = "pairs" if compiler.tf32 else "values"
            return
        if len({p.dtype for p in self.params}) > 1:
            raise ValueError("a compiled private step needs the trainable parameters in one dtype (its clipped sums "
                             "are one flat buffer)")
        self.compiled.microbatch = compiler(self._microbatch_flat, "microbatch")
        self.compiled.copy_first = compiler.reuses_outputs

    def close(self) -> None:
        """Remove every hook it put on the model (idempotent)."""
        self.taps.close()
        self.closed = True

    def __enter__(self) -> "Privatizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def gradient(self, microbatches, loss_fn, shapes: dict[nn.Parameter, torch.Size],
                 projections: dict[nn.Parameter, Callable[[], Projection]] | None = None) -> PrivateGradient:
        """One logical step's privatised gradient (of shape `shapes[p]` per parameter) and summed per-sample loss.

        Args:
            microbatches (list[dict[str, torch.Tensor]]): the logical batch as physical micro-batches; their
                clipped sums are added. An empty list is a step whose sampled batch was empty: it still releases
                noise.
            loss_fn (Callable): `loss_fn(model, microbatch)` returns one loss per sample (`reduction="none"`),
                loss[i] a function of sample i alone: a batch statistic mixed in (`losses + losses.mean()`) lets one
                record change the others' clipped gradients, which voids ε; the attribution proof refuses it.
            shapes: each parameter's gradient shape (`{p: p.shape for p in privatizer.params}`).
            projections: DP-GRAPE, one pass only: makes a parameter's projection when its layer's gradient arrives;
                its per-sample gradients, clipped sum and noise are then projected ones.

        Returns:
            `PrivateGradient(gradient, loss_sum)`: each parameter's (Σᵢ clipped gᵢ + N(0, σ²C²)) / (q·n), and this
            rank's summed per-sample loss as the noise releases it.

        Raises:
            RuntimeError: after `close()`.
        """
        if self.closed:
            raise RuntimeError("Privatizer.gradient after close(): its hooks are removed from the model; make a new "
                               "Privatizer (or a method: build_method) to take another step")
        for observer in self.observers:
            microbatches, loss_fn = observer.on_microbatches(self, microbatches, loss_fn)
        summed, loss_sum = self.clip_and_accumulate(microbatches, loss_fn, shapes, projections)
        loss_sum = self.mechanism.released_loss(loss_sum)
        if self.compiled.flat is not None:  # a compiled step
            # the ranks' sums reduced eagerly (a collective); the release noises the flat sum's runs in place
            flat, self.compiled.flat = self.compiled.flat, None
            distributed.sum_([flat])
            return PrivateGradient(self.mechanism.release(summed, flat=flat), loss_sum)
        with exact_float32(self.device):
            summed = self.sum_over_ranks(summed)
            for observer in self.observers:
                summed = observer.on_clipped(self, summed)
            released = self.mechanism.release(summed, self._shard_noise() if self.sharded else None)
            for observer in reversed(self.observers):
                released = observer.on_noised(self, released)
        return PrivateGradient(released, loss_sum)

    def clip_and_accumulate(self, microbatches, loss_fn, shapes, projections=None):
        """(Σᵢ min(1, C/‖gᵢ‖)·gᵢ per parameter over this rank's micro-batches, their summed per-sample loss), as
        the clipping plan says."""
        if projections and self.plan.passes != 1:
            raise ValueError(f"projected per-sample gradients need one-pass clipping, not {self.plan.name!r}")
        projections = projections or {}
        if microbatches and self._unsettled():
            self._rehearse(microbatches[0], loss_fn, shapes, projections)
        if self.compiled.microbatch is not None:
            return self._compiled_pass(microbatches, loss_fn, shapes, projections)
        return self._eager_pass(microbatches, loss_fn, shapes, projections)

    def _unsettled(self) -> bool:
        """A compiled step has still to learn from an eager micro-batch: the attribution proof, dp-sgd-rc's probe
        shapes, or the probes of a forward compiled alone."""
        step = self.compiled
        if step.microbatch is None and step.forward is None:
            return False
        return (self._check_coverage or (self._probe_draws is not None and step.probe_shapes is None)
                or (step.forward is not None and not step.probes_made))

    def _rehearse(self, mb, loss_fn, shapes, projections) -> None:
        """A compiled run's eager micro-batches, on the step's first and released nowhere, until the compiled step
        has learnt what it needs (`_unsettled`). Every released step is then the compiled one, a resumed process's
        first as an uninterrupted one's: bit for bit the same (an eager step differs by float rounding, outside ε
        where a lost attempt released it). What they draw is put back: the global generator (dropout), the step's
        probe key, `.grad`."""
        grads = [p.grad for p in self.params]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            while self._unsettled():
                with rewound(self.step_keys):
                    self._eager_pass([mb], loss_fn, shapes, projections)
        for p, g in zip(self.params, grads):
            p.grad = g

    def _eager_pass(self, microbatches, loss_fn, shapes, projections):
        """The micro-batches' clipped sums and loss sum, each micro-batch eager (a forward compiled alone is still
        called by it); the first one of a run proves attribution."""
        estimated = self._probe_draws is not None
        summed = {}  # made by the first micro-batch's clipped sums (`_accumulate`)
        loss_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(self._with_step_probes(microbatches)):
            # a compiled run learns which probes each parameter draws
            probes = [Recorded(d) for d in self._parameter_probes()] if estimated else None
            loss_sum = loss_sum + self.microbatch(mb, loss_fn, projections, summed, self._zero, self._check_coverage,
                                                  probes, shapes)
            self.compiled.probe_shapes = [r.shapes for r in probes] if estimated else None
            self._check_coverage = False
            for observer in self.observers:
                observer.on_accumulated(self, summed, i)
        # two passes: .grad's sums, FSDP's shards
        return self._completed(summed, shapes if self.plan.passes == 1 else None), loss_sum

    def sum_over_ranks(self, summed: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """The clipped sums of the whole logical batch, on every rank (FSDP's shards are reduced already)."""
        distributed.sum_(s for s in summed.values() if not sharding.is_sharded(s))
        return summed

    def clipped_sum_of(self, grads: dict, k: int | None = None) -> dict:
        """Σᵢ min(1, C/‖gᵢ‖)·gᵢ of per-sample gradients given outside a backward pass (dpmem audit's canaries:
        `Factored` or dense rows, keyed like the clipped sums), through the real samples' code: the plan's norm
        rule and reducer, the clip factors, the weighted sum. A fault there shows in the audit. `k`: the rows are
        users' records, k to a user, clipped per user as a `Grouped` micro-batch's are."""
        reduce = self._reducer()
        if k is not None and self.mechanism.per_user:  # (rows, not a micro-batch: `ClippedUnit.reducers`' rule)
            reduce = reducers.by_user(reduce, k)
        reduced = {key: reduce(g) for key, g in grads.items()}
        factors = self.mechanism.clip_factors(_squares(reduced))
        return weighted_sum({key: r.grads for key, r in reduced.items()}, factors)

    def _reducer(self, probes=None):
        """Squared norms by the plan's rule, and the per-sample gradients kept for the clipped sum (dense for
        materialize, else as they come: a layer's factors for book-keeping): one-pass clipping's reducer, and the
        audit's canaries' under any plan (`clipped_sum_of`). `probes`: the estimators' draws, if not the step's."""
        dense = self.plan.keeps == "gradients"
        return reducers.normed(self.plan.norms, self.plan.k, probes or self._probe_draws,
                               **({"then": reducers.materialize} if dense else {}))

    def _shard_noise(self) -> Draws | None:
        """This rank's draws of the step's noise on its FSDP shards (None on meta, where nothing is drawn)."""
        return None if self.step_keys is None else self.step_keys.child(f"shard-noise/{distributed.rank()}")

    def _with_step_probes(self, microbatches):
        """The micro-batches, dp-sgd-rc's probe draws keyed anew before each by the step's key."""
        key = self.step_keys.next_key() if self._probe_draws is not None else None
        for mb in microbatches:
            if key is not None:
                self._probe_draws.key, self._probe_draws.count = key, 0
            yield mb

    def _parameter_probes(self) -> list[Draws]:
        """Each parameter's probe draws for this micro-batch, keyed by the step's key and its place in `params`: the
        probes a layer gets do not hang on the order the layers are reduced in, which differs (an eager backward pass
        estimates a layer whose output gradient is large as it reaches it, the others after it; a compiled one, whose
        graph cannot draw, all after it)."""
        draws = self._probe_draws
        return [Draws(draws.key, f"{draws.purpose}/{i}", draws.device) for i in range(len(self.params))]

    def _compiled_pass(self, microbatches, loss_fn, shapes, projections):
        """One-pass clipping by the compiled micro-batch: every parameter's clipped sum in one flat tensor (the first
        micro-batch's own, later ones added in place), kept for the release and returned as views."""
        step = self.compiled
        if step.sum_shapes is None:
            step.sum_shapes = [torch.Size(shapes[p]) for p in self.params]
        flat, loss_sum = None, torch.zeros((), device=self.device)
        for mb in self._with_step_probes(microbatches):
            # the estimators' probes drawn here, as the eager step draws them, and passed in
            probes = None if self._probe_draws is None else [
                Drawn.of(d, s) for d, s in zip(self._parameter_probes(), step.probe_shapes)]
            part, loss = step.microbatch(mb, loss_fn, projections, self._zero, probes)
            # the first part kept (a copy where the next replay would overwrite it), later ones added into it
            flat = (part.clone() if step.copy_first else part) if flat is None else flat.add_(part)
            loss_sum = loss_sum + loss
        if flat is None:
            flat = torch.zeros(sum(s.numel() for s in step.sum_shapes), device=self.device, dtype=self.params[0].dtype)
        step.flat = flat
        chunks = flat.split([s.numel() for s in step.sum_shapes])  # a vector's chunk as it is: a view op fewer
        summed = {p: c if len(s) == 1 else c.view(s) for p, c, s in zip(self.params, chunks, step.sum_shapes)}
        return summed, loss_sum

    def microbatch(self, mb, loss_fn, projections, summed, zero, check, probes, shapes) -> torch.Tensor:
        """One micro-batch: Σᵢ min(1, C/‖gᵢ‖)·wᵢ·gᵢ added into `summed` (in place; a parameter's first part becomes
        its sum); returns its clipped loss sum. One pass weighs the kept per-sample gradients (dense, factors or
        projections); two keep norms only, and a second backward pass of Σᵢ fᵢ·Lᵢ forms the sums. `check`: prove
        attribution on it (the first micro-batch; one whose layers are read anew proves itself, `NewLayout`).
        `shapes`: each parameter's kept shape, which a streamed value takes; None: nothing streams (a compiled
        one-pass step)."""
        unit = ClippedUnit.of(mb, self.mechanism.per_user)  # ULS: a user's k records, normed and clipped as one
        while True:
            try:
                return self._microbatch(mb, loss_fn, projections, summed, zero, check, probes, shapes, unit)
            except NewLayout:  # layers read per sample as no proof has seen yet: this micro-batch proves them
                check = True
            except Reread:  # the proof failed where a layer reads both ways: proved again, read the other way
                check = True

    def _microbatch(self, mb, loss_fn, projections, summed, zero, check, probes, shapes, unit: ClippedUnit):
        two_pass = self.plan.passes == 2
        # the proof's public weights: one per clipped unit (a user under ULS), its records weighed as it is
        w = public_weights(unit.count(mb), self.device) if check else None

        def reducer(draws):
            if two_pass:  # norms only; with the check, Σᵢ wᵢ gᵢ too
                norm = reducers.norms(self.plan.norms, self.plan.k, draws)
                return reducers.with_sum(norm, w) if check else norm
            return self._reducer(draws)  # materialize: dense per-sample gradients; book-keeping: the factors
        keeps = [reducer(d) for d in probes] if probes else [reducer(None)] * len(self.params)
        reduce = unit.reducers({p: reducers.projected(projections[p], keep) if p in projections else keep
                                for p, keep in zip(self.params, keeps)})
        record_w, loss_fn = unit.per_record(w), unit.loss_fn(loss_fn)  # each record weighed as its unit
        losses, kept, batch_grads, read = self._backward(mb, loss_fn, zero, reduce, check, shapes, two_pass, record_w)
        for p, g in batch_grads.items():
            p.grad = g
        # no_grad: the taps' kept layer inputs are the forward's own tensors (not detached); nothing here is recorded
        with exact_float32(self.device), torch.no_grad():
            if two_pass:
                if check:
                    self._verify({p: r.total for p, r in kept.items()}, None, mb, loss_fn, record_w, read)
                    kept = {p: r.value for p, r in kept.items()}
                squares, grads = kept, {}
            else:
                squares = _squares(kept)  # the squared norms made as each parameter was reduced (the rows' now)
                grads = {p: r.grads for p, r in kept.items()}
                if check:
                    self._verify(weighted_sum(grads, w), lambda p, g: reducers.projection(projections[p]).project(g)
                                 if p in projections else g, mb, loss_fn, record_w, read)
            del kept
            factors = self.mechanism.clip_factors(squares) * unit.weights(mb)
            with memory_label("gradients"):
                for p, part in weighted_sums(grads, factors):
                    _accumulate(summed, p, part)
            del grads
        if two_pass:
            self._second_pass(losses, unit.per_record(factors), summed)
        return unit.loss(self.mechanism.clipped_losses(losses.detach()), mb)

    def _second_pass(self, losses, factors, summed) -> None:
        """Two-pass clipping's second backward pass: autograd forms Σᵢ fᵢ gᵢ, in the model's own precision, added
        into `summed`: returned as values, or under FSDP in .grad, reduce-scattered into the shards."""
        wide = torch.promote_types(losses.dtype, factors.dtype)  # a bf16 loss is weighed in float32
        weighted = (losses.to(wide) * factors.to(wide)).sum()
        if not self.sharded:
            for p, g in zip(self.params, torch.autograd.grad(weighted, self.params, allow_unused=True)):
                if g is not None:
                    _accumulate(summed, p, g)
            return
        weighted.backward()
        self._zero.grad = None  # what the second pass sent the whole layers' probes
        for p in self.params:  # out of .grad before the next micro-batch
            if p.grad is not None:
                _accumulate(summed, p, p.grad)
                p.grad = None

    def _backward(self, mb, loss_fn, zero, reduce, check, shapes, retain_graph=False, weights=None):
        """(the micro-batch's per-sample losses, `Taps.per_sample`'s kept values, autograd's gradients of
        Σᵢ wᵢ ℓᵢ where `check` (else {}), its layers' layouts): the forward recorded and one backward pass to the taps'
        probes, where each layer's reduced values stream unless `shapes` is None or `check` (the attribution proof's
        micro-batch: it adds a backward pass of Σᵢ wᵢ ℓᵢ, `weights` w, to the parameters; under FSDP into the
        reduce-scattered `.grad`). Raises `NewLayout`, before any backward pass, where this micro-batch's layers are
        read per sample as no proof has seen."""
        # a compiled forward (a checkpointed model's, a TF32 run's) runs once an eager one has made its probes
        compiled = self.compiled.forward is not None and not check
        forward = self.compiled.forward if compiled and self.compiled.probes_made else self._forward
        stream = None if shapes is None or check else self.compiled.streamed
        while True:
            failed = None
            with self.taps.recording(zero, batch_size(mb), reduce, shapes, stream, compiled) as tape:
                try:
                    out = forward(mb, loss_fn)
                except (RuntimeError, ValueError) as e:  # the model's: raised below, once the recording is over
                    failed = e
            if failed is not None:
                self._refuse_broadcast(tape, failed, mb, loss_fn)
            losses = per_sample(out, mb)
            self._ambiguous = tape.ambiguous  # what the proof may read the other way (`Taps.reread`)
            read = tuple(zip((owner.name for owner in tape.owners), tape.layouts))
            if not check and self._proven is not None and read not in self._proven \
                    and not torch.compiler.is_compiling():
                raise NewLayout(read)
            batch_grads = {}
            if check:
                weighted = (losses * weights.to(losses.dtype)).sum()
                if self.sharded:
                    weighted.backward(retain_graph=True)
                    zero.grad = None
                else:
                    grads = torch.autograd.grad(weighted, self.params, allow_unused=True, retain_graph=True)
                    batch_grads = dict(zip(self.params, grads))
            try:
                kept, _ = self.taps.per_sample(tape, losses.sum(), False, retain_graph)
            except RepeatedUse:  # a layer called twice: run again, its uses summed before they are reduced
                continue
            self.compiled.probes_made = self.compiled.probes_made or compiled
            return losses, kept, batch_grads, read  # under FSDP the batch gradient is in .grad already

    def _refuse_broadcast(self, tape, error: Exception, mb, loss_fn) -> NoReturn:
        """A recorded forward raised `error`: where it runs with the outputs shared by the batch left unbroadcast
        (`Taps.broadcast_broke`), one line naming the first such layer and the fix; else `error` as it was."""
        names = self.taps.broadcast_broke(tape, lambda: self._forward(mb, loss_fn))
        if not names:
            raise error
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        more = f" (and {len(names) - 1} more before it failed: {', '.join(names[1:])})" if len(names) > 1 else ""
        raise RuntimeError(f"{names[0]}{more}: its output is shared by the batch (one row); broadcast to B rows, so "
                           f"that each sample gets its own gradient, it broke the model's forward ({first}), which "
                           "runs with it left shared: the model sizes that output by other rows itself (Swin's "
                           "position bias, added to B·windows rows), so no rule splits its gradient by sample; "
                           f"{freeze_fix('its parameters', names[0] + '.*')}") from error

    def _verify(self, totals, transform, mb, loss_fn, weights, read) -> None:
        """The attribution proof (`verify_attribution`) of a micro-batch whose layers were read as `read`, which it
        adds to those proved; on a mismatch it says why: where samples mix, rows misread, or a use outside."""
        def explain(names: list[str]) -> str:
            if self.taps.reread(self._ambiguous, [name.rpartition(".")[0] for name in names]):
                raise Reread
            misread = rows_misread(dict(read), names)
            if misread is not None:
                return misread
            with torch.enable_grad():
                mixing = where_samples_mix(self.model, lambda: per_sample(self._forward(mb, loss_fn), mb), weights,
                                           names)
            return mixing or used_outside(names)
        verify_attribution(self.model, self.params, totals, transform, self.taps.compute, explain)
        if self._proven is not None:
            self._proven.add(read)

    def _forward(self, mb, loss_fn) -> torch.Tensor:
        """The per-sample losses on `mb` (what `compile` compiles alone: a checkpointed model's, a TF32 run's)."""
        return loss_fn(self.model, mb)

    def _microbatch_flat(self, mb, loss_fn, projections, zero, probes) -> tuple[torch.Tensor, torch.Tensor]:
        """`microbatch` with its clipped sums returned as one flat tensor, in the parameters' order (the compiled
        step's: one output, not one per parameter), and its clipped loss sum."""
        summed, shapes = {}, dict(zip(self.params, self.compiled.sum_shapes))
        # one pass keeps its layers whole: a graph with a function per layer ran host-bound grape at 0.83× compiled
        # AdamW's samples/s, 0.91× without (docs/benchmarks/compile.md); two passes stream their norms
        loss = self.microbatch(mb, loss_fn, projections, summed, zero, False, probes,
                               shapes if self.plan.passes == 2 else None)
        return torch.cat([s.reshape(-1) for s in self._completed(summed, shapes).values()]), loss

    def _completed(self, summed, shapes=None) -> dict[nn.Parameter, torch.Tensor]:
        """Every parameter's clipped sum: zeros (of `shapes[p]`, else of p: a shard under FSDP) for one that no
        micro-batch reached."""
        with memory_label("gradients"):
            return {p: summed[p] if p in summed else
                    torch.zeros_like(p) if shapes is None else torch.zeros(shapes[p], device=p.device, dtype=p.dtype)
                    for p in self.params}


class Reread(Exception):
    """The attribution proof failed on a layer read time-major whose output reads as B·k batch-major rows too: the
    micro-batch runs again, that layer read batch-major, and is proved so (nothing was summed or released)."""


class NewLayout(Exception):
    """A micro-batch's layers were read per sample (`Tape.layouts`) as no attribution proof has seen: it runs again
    with the proof (raised after its forward pass, before any backward pass)."""


def _squares(kept: dict) -> dict:
    """The per-sample squared norms of one-pass clipping's `Normed` values, by parameter (`grouped_squares`)."""
    return grouped_squares({p: r.squares for p, r in kept.items() if r.squares is not None},
                           {p: r.grads for p, r in kept.items() if r.squares is None})


def _accumulate(summed: dict, p: nn.Parameter, part: torch.Tensor) -> None:
    """The first micro-batch's part becomes the sum itself (no zeroed model-sized buffer beside it); later ones
    are added in place."""
    summed[p] = part if p not in summed else summed[p].add_(part)
