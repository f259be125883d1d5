"""Per-sample capture that returns values: the one capture of dpmem's private step, and of the spectrum analysis.

Each covered layer gets one forward hook (a "tap") that, inside `Taps.recording`, notes the layer on the step's `Tape`
and ties zero probes (expanded views of one scalar leaf) to its output, so that one `torch.autograd.grad` call to the
probes returns every layer's part and computes no parameter's batch gradient. A part is streamed (a custom autograd
function, `_Stream`, saves the layer's input and reduces in the backward pass, so the output gradient is freed there
and activation checkpointing recomputes the input), a pair (the same function returns output gradient and input, for
values that cannot stream) or whole (a zero added to the output). Nothing mutates state inside the backward pass, so
eager and compiled steps are the same code. docs/design.md §7 says which layers take which form, and why.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from itertools import accumulate
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpmem.metering import memory_label
from dpmem.persample.fallback import capture_call, check_deterministic, fallback_grads, leading_dims, replay_of
from dpmem.persample.owners import (SHARED, TIME_MAJOR, Owner, ambiguous, batch_first, find_owners, layout,
                                    owned_parameters, tensor_output, tied_sum)
from dpmem.persample.reducers import Reducer, Stream, materialize
from dpmem.persample.registry import inner_call
from dpmem.precision import Compute, exact_float32, tf32_enabled

# An eager step streams a layer only where its output gradient has at least this many elements: streaming frees at
# most that (256 KiB in float32) per layer early, and its autograd function costs the host about 80 µs a layer
# (host-bound grape ran 17 % slower streaming every layer of issue 32's 12-block proxy). A compiled step, which pays
# no such cost, streams every layer it can.
STREAM_MIN_ELEMENTS = 2**16


def rule_gradients(owner: Owner, saved, grad_output: torch.Tensor, batch: int, read: str | int) -> dict:
    """A rule-covered layer's per-sample gradients by parameter name, from its input and output gradient made
    batch-first as its output was read (`owners.layout`; streamed in the backward pass, or after it)."""
    saved, grad_output = batch_first(owner, saved, grad_output, batch, read)
    return owner.rule.gradients(owner.module, saved, grad_output)


def remove_handles(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class Tape:
    """One forward pass's records, in call order: the layer (a shared one once per use), what its rule keeps (None
    where streamed) and its probes; and what is streamed, by layer."""

    def __init__(self, zero: torch.Tensor, batch: int, reducers: dict, streams: dict[int, tuple], min_elements: int,
                 in_graph: bool):
        self.leaf, self.batch, self.reducers, self.streams = zero, batch, reducers, streams
        self.zeros = {zero.dtype: zero}  # the leaf, and its casts to the outputs' dtypes (one op per dtype)
        self.min_elements = min_elements  # the smallest output gradient that streams (`STREAM_MIN_ELEMENTS`)
        # recorded inside a compiled graph, which makes its probes there; else they are views made outside (an
        # eager forward's, and a compiled forward's inputs, `_Hooks.probes`)
        self.in_graph = in_graph
        self.owners: list[Owner] = []
        self.saved: list[Any] = []
        self.probes: list[list[torch.Tensor]] = []
        self.streamed: list[bool] = []  # whether each use streamed (its values or its pair), else it is whole
        # how each use's output is read per sample (`owners.layout`; a replayed layer's batch dimensions): what the
        # attribution proof proves, and the signature whose change asks for that proof again
        self.layouts: list = []
        self.dtypes: dict = {}  # the outputs' dtypes, for the proof's tolerance (a dict: dynamo traces no set)
        self.armed = True  # values asked for in the first backward pass only (two-pass clipping's second passes)
        self.calls: dict[int, int] = {}  # calls so far of each layer (by id: a plain dict, as dynamo traces it)
        self.repeated: list[Owner] = []  # streamed layers called twice (found in the forward pass)
        self.broadcast: list[str] = []  # the layers whose outputs, shared by the batch, were broadcast to B rows
        # the layers read time-major whose outputs read as B·k rows too, by name: their outputs' leading dimensions
        self.ambiguous: dict[str, tuple[int, int]] = {}

    def zeros_like(self, shape, dtype: torch.dtype) -> torch.Tensor:
        zero = self.zeros.get(dtype)
        if zero is None:
            zero = self.zeros[dtype] = self.leaf.to(dtype)
        return zero.expand(shape)


class RepeatedUse(Exception):
    """A streamed layer was called more than once in one forward pass: its uses must be summed before they are
    reduced, so the micro-batch runs again with the layer whole (`Taps.per_sample` raises it before any backward)."""


class Taps:
    """Per-sample gradients of every trainable parameter of `model`, as values:

        with taps.recording(zero, batch_size, reducers) as tape:
            losses = loss_fn(model, batch)
        kept, batch_grads = taps.per_sample(tape, losses.sum())

    `kept` holds, per parameter, its reducer (`dpmem.persample.reducers`; `materialize` by default) applied to its
    per-sample gradient summed over every use (a tied weight is one gradient); `zero` is `taps.zero()`, made once
    outside any compiled function; `taps.gradients(...)` does it all in one call. The hooks act only inside
    `recording` (and a checkpoint's recompute of a recorded forward), so several Taps on one model do not
    interfere; `close()` removes them, as does garbage collection."""

    def __init__(self, model: nn.Module, whole: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 pairs: bool = False):
        self.model, self.whole = model, whole  # whole: a sharded parameter gathered whole (FSDP's, given by the step)
        # pairs: stream the layers whose values cannot (their output gradient and input), so that activation
        # checkpointing drops the input in between; without it they cost a Python function per layer and save nothing
        self.pairs = pairs
        self.owners = find_owners(model)
        self.parameters = owned_parameters(self.owners)
        # a parameter owned by several layers (a tied LM head) is normed on the sum of its uses: never streamed
        owned = Counter(p for owner in self.owners for p in owner.params.values())
        # ids: dynamo traces no set of tensors
        self._shared = {id(owner) for owner in self.owners if any(owned[p] > 1 for p in owner.params.values())}
        self._repeated: set[int] = set()  # layers found called twice in a forward pass: never streamed
        self.compute = Compute()  # what the last step's backward computed in (the attribution proof's tolerance)
        self._hooks = hooks = _Hooks()
        self._handles = []
        self._close = weakref.finalize(self, remove_handles, self._handles)
        for owner in self.owners:
            if inner_call(owner.rule, owner.module):
                self._handles.append(owner.module.register_forward_pre_hook(
                    functools.partial(hooks.enter_call, owner), with_kwargs=True))
            self._handles.append(owner.module.register_forward_hook(
                functools.partial(hooks.tap, owner), with_kwargs=True))

    def zero(self) -> torch.Tensor:
        """The probes' scalar leaf (float32; each probe takes its output's dtype)."""
        return torch.zeros((), device=self.parameters[0].device, requires_grad=True)

    def close(self) -> None:
        """Remove the taps from the model (idempotent)."""
        self._close()

    def __enter__(self) -> "Taps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def gradients(self, forward, batch: int, reducers: dict[nn.Parameter, Reducer] | None = None) -> dict:
        """{parameter: its reducer's value} of the summed per-sample loss that `forward()` returns."""
        with self.recording(self.zero(), batch, reducers) as tape:
            loss = forward()
        return self.per_sample(tape, loss)[0]

    # -- recording -----------------------------------------------------------------------------------------
    def recording(self, zero: torch.Tensor, batch: int, reducers: dict[nn.Parameter, Reducer] | None = None,
                  shapes: dict | None = None, stream: str | None = "values", compiled: bool = False) -> "_Recording":
        """Record one forward pass of `batch` samples. `shapes`: each parameter's kept shape where it differs from
        its own (DP-GRAPE's projections). `stream`: what may stream out of the backward pass: "values" (reduced
        values, else pairs), "pairs" (reduced after the backward pass: outside a TF32 graph), None (nothing).
        `compiled`: the forward is a compiled function of its own (its backward AOTAutograd's: a checkpointed
        model's, a TF32 run's), or an eager one that makes its probes for it."""
        return _Recording(self, zero, batch, reducers or {}, shapes or {}, stream, compiled)

    def start(self, zero, batch, reducers, shapes, stream, compiled) -> Tape:
        in_graph = torch.compiler.is_compiling()
        compiled = compiled or in_graph
        streams = self._streams(batch, reducers, shapes, compiled, stream == "values") if stream else {}
        # a compiled step, which pays no host time per function, streams every layer it can
        tape = Tape(zero, batch, reducers, streams, 0 if compiled else STREAM_MIN_ELEMENTS, in_graph)
        self._hooks.tape = tape
        # kept for a checkpoint's recompute; a compiled step's would carry its graph's tensors out of it
        self._hooks.recorded = None if in_graph else tape
        return tape

    def _streams(self, batch: int, reducers: dict, shapes: dict, compiled: bool, values: bool) -> dict[int, tuple]:
        """What streams out of the backward pass, by layer: id(owner) -> (its parameters' reducers, the probes'
        (shape, dtype)) where every reducer streams its value (and `values`), else, with `pairs`, (None, None) where
        the layer's input is a float tensor: its output gradient and input stream out as they are, to be reduced
        after the backward."""
        out = {}
        for owner in self.owners:
            if owner.rule is None:
                continue
            if owner.rule.float_input and self.pairs:
                out[id(owner)] = (None, None)
            if id(owner) in self._repeated or id(owner) in self._shared or not values:
                continue
            kinds, probes = [], []
            for p in owner.params.values():
                stream = reducers.get(p)
                kept = shapes.get(p, p.shape)
                made = stream.shapes(batch, kept, p.dtype, owner.rule.float_input, owner.rule.factored(owner.module)) \
                    if isinstance(stream, Stream) and not (stream.draws and compiled) else None
                if made is None:
                    break
                kinds.append(stream)
                probes += made
            else:
                out[id(owner)] = (kinds, probes)
        return out

    # -- per-sample gradients -------------------------------------------------------------------------------
    def per_sample(self, tape: Tape, loss: torch.Tensor, batch_gradients: bool = False,
                   retain_graph: bool = False) -> tuple[dict, dict]:
        """({parameter: its reducer's value}, {parameter: autograd's batch gradient} if `batch_gradients` (a
        check of the sums against it) else {}), from one backward pass of `loss`, the summed per-sample loss
        recorded on `tape`.
        A whole part is reduced once every use's gradient is in (uses taken last to first, as a backward pass
        reaches them), and each layer's output gradient dropped as soon as its rule has used it."""
        if tape.repeated:
            self._repeated.update(id(owner) for owner in tape.repeated)
            raise RepeatedUse(", ".join(dict.fromkeys(owner.name for owner in tape.repeated)))
        params = self.parameters if batch_gradients else []
        probes = [probe for use in tape.probes for probe in use]
        if not probes and not params:  # closed: nothing recorded
            return {}, {}
        grads = list(torch.autograd.grad(loss, [*probes, *params], allow_unused=True, retain_graph=retain_graph))
        tape.armed = False
        batch_grads = dict(zip(params, grads[len(probes):]))
        del grads[len(probes):]
        self.compute = Compute(tf32=tf32_enabled(loss.device))
        for dtype in tape.dtypes:
            self.compute = self.compute.lowered(dtype)
        starts = [0, *accumulate(len(use) for use in tape.probes)]
        uses = Counter(p for owner in tape.owners for p in owner.params.values())
        pending, kept = {}, {}  # by parameter: its uses' summed gradients until all are in; its reduced value
        # no_grad: the rules' products on the kept inputs (not detached: an op fewer per layer) record no graph
        with memory_label("per_sample"), exact_float32(loss.device), torch.no_grad():
            for i in self._order(tape):
                owner, saved = tape.owners[i], tape.saved[i]
                parts = grads[starts[i]:starts[i + 1]]
                grads[starts[i]:starts[i + 1]] = [None] * len(parts)
                tape.saved[i] = None
                kinds = tape.streams[id(owner)][0] if tape.streamed[i] else None
                if kinds is not None:
                    if parts and parts[0] is not None:  # None: this use's output did not reach the loss
                        for stream, p in zip(kinds, owner.params.values()):
                            kept[p], parts = stream.unpack(parts)
                    continue
                if tape.streamed[i]:  # a pair: (output gradient, input)
                    saved = parts[1]
                if owner.rule is None and any(g is not None for g in parts):  # replayed: every output leaf's
                    parts = [parts]
                if parts and parts[0] is not None:
                    for name, part in self._gradients(owner, saved, parts[0], tape.batch, tape.layouts[i]):
                        p = owner.params.get(name)
                        if p is not None:  # None: a frozen parameter of a rule-covered module
                            pending[p] = part if p not in pending else tied_sum(pending[p], part)
                for p in owner.params.values():
                    uses[p] -= 1
                    if uses[p] == 0 and p in pending:  # every use is in: reduce it, free the rest
                        kept[p] = tape.reducers.get(p, materialize)(pending.pop(p))
        return kept, batch_grads

    def broadcast_broke(self, tape: Tape, forward: Callable[[], Any]) -> list[str]:
        """After a recorded forward pass raised: the layers whose outputs, shared by the batch, it had broadcast to B
        rows, where `forward` (the same pass) runs with them left shared: their model sizes them by other rows itself
        (Swin's position bias, added to B·windows rows). [] where nothing was broadcast or it fails again."""
        if not tape.broadcast:
            return []
        self._hooks.broadcast = False
        try:
            with torch.no_grad(), self.recording(self.zero(), tape.batch, stream=None):
                forward()
        except Exception:  # noqa: BLE001  (not the broadcast's doing: the caller raises the first error)
            return []
        finally:
            self._hooks.broadcast = True
        return list(dict.fromkeys(tape.broadcast))

    def reread(self, ambiguous: dict[str, tuple[int, int]], modules: list[str]) -> bool:
        """After a failed attribution proof: whether any of `modules` (those of the parameters that failed) is among
        the `ambiguous` layers (`Tape.ambiguous`: read time-major, their outputs read as B·k batch-major rows too:
        Swin's windows). If so, they and every ambiguous layer whose output leads with the same two dimensions (fed
        the same rows, whose own small gradients may pass the proof's tolerance misread) are read batch-major from
        now on, and the micro-batch should be proved again."""
        failed = {ambiguous[m] for m in modules if m in ambiguous}
        flip = {name for name, dims in ambiguous.items() if dims in failed} - self._hooks.batch_major
        self._hooks.batch_major |= flip
        return bool(flip)

    def _order(self, tape: Tape) -> list[int]:
        """The uses in the order they are reduced after the backward pass: last to first, as the backward pass
        reaches the layers that can stream, then those that cannot (a weight used several times, the fallback's
        layers). Those that streamed were reduced in the backward pass, so an estimator's probes are its
        parameter's own draws (`Privatizer._parameter_probes`), not the next in this order."""
        alone = [owner.rule is not None and tape.calls[id(owner)] == 1 and id(owner) not in self._shared
                 for owner in tape.owners]
        last_first = list(reversed(range(len(tape.owners))))
        return [i for i in last_first if alone[i]] + [i for i in last_first if not alone[i]]

    def _gradients(self, owner: Owner, saved, grad_output, batch: int, read):
        """A layer's per-sample gradients by parameter name: by its rule from its input and output gradient, read as
        `read`, or by the fallback's replay from its call and its output leaves' gradients (`grad_output`, a list)."""
        if owner.rule is not None:
            return rule_gradients(owner, saved, grad_output, batch, read).items()
        self._hooks.replaying = True
        try:
            # sharded (FSDP resharded the module after the backward), its replay runs on the parameters made whole
            whole = None if self.whole is None else {n: self.whole(q) for n, q in owner.module.named_parameters()}
            call, dims = saved
            replay = replay_of(owner.module)
            return fallback_grads(owner.module, list(owner.params), call, grad_output, dims, batch,
                                  replay is not None and replay.loop, whole).items()
        finally:
            self._hooks.replaying = False


class _Hooks:
    """The taps' forward hooks and what they share: the tape being recorded, the last recorded one (for a checkpoint's
    recompute) and the fallback's replay. The model's hooks hold this, not the `Taps`, so that dropping a Taps removes
    them (its finalizer); dynamo traces them as plain methods."""

    def __init__(self):
        self.tape: Tape | None = None
        self.recorded: Tape | None = None  # the last forward proper's, whose streams a recompute saves again
        self.replaying = False  # the fallback's replay of a layer, whose submodules' taps stay out of it
        self.broadcast = True  # outputs shared by the batch broadcast to B rows (off: `Taps.broadcast_broke`)
        self.batch_major: set[str] = set()  # layers whose outputs read both ways are read as B·k rows (`Taps.reread`)
        self.entered: list[InnerCall] = []  # the `InnerCall`s entered and not yet left, in order
        # each streamed layer's zeros, made once per shape and leaf and kept: views made outside any graph serve
        # every step (a gradient is captured where it enters them; what made them never runs)
        self.zeros: dict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def enter_call(self, owner: Owner, mod, args, kwargs):
        """Before a subclass's own forward (`registry.inner_call`): its rule's call on the weight is tapped inside."""
        if self.tape is not None or self.recomputing():
            call = InnerCall(owner, functools.partial(self.use, owner))
            call.__enter__()
            owner.inner_calls.append(call)
            self.entered.append(call)

    def abandon(self) -> None:
        """After a forward pass that raised inside a subclass's own forward: its `InnerCall`s left, last first, so
        that no mode stays on torch's stack and the next forward starts clean."""
        while self.entered:
            call = self.entered.pop()
            call.owner.inner_calls.remove(call)
            call.__exit__(None, None, None)

    def recomputing(self) -> bool:
        """Activation checkpointing's recompute (a forward inside a backward pass) of a recorded forward."""
        if self.replaying:
            return False
        if torch._C._current_graph_task_id() == -1:  # a forward pass proper
            self.recorded = None
            return False
        return self.recorded is not None

    def tap(self, owner: Owner, mod, args, kwargs, output):
        if self.tape is None and not self.recomputing():
            return None
        if owner.rule is None:  # replayed; in a recompute its call is on the tape already
            return None if self.tape is None else self.replayed(self.tape, owner, mod, args, kwargs, output)
        if owner.inner_calls:  # a subclass's own forward, its call entered by the pre-hook (`enter_call`)
            call = owner.inner_calls.pop()
            self.entered.remove(call)
            call.__exit__(None, None, None)
            if call.made:  # tapped inside, where the forward called the rule's function
                return None
            # no such call (Falcon's Linear multiplies by the weight itself): read at the layer's input and output,
            # which the attribution proof confirms or refuses
        output = tensor_output(owner, output)
        return self.use(owner, output, owner.rule.capture(mod, args, kwargs, output))

    def use(self, owner: Owner, output: torch.Tensor, saved):
        """One use of a rule-covered layer: `output` (its output, or what its rule's function returned inside a
        subclass's forward) tapped, with `saved`, what its rule keeps."""
        tape = self.tape
        if tape is None:  # a recompute: a streamed use saves what the forward saved (zeros of its own, never asked)
            tape = self.recorded
            if not streams(tape, owner, output):  # whole: its input is on the tape, its zero adds no saved tensor
                return output
            probes = self.probes(tape, owner, _shapes(tape, owner, output, saved), -1)
            return _Stream.apply(output, saved, None, *probes)
        tape.dtypes[output.dtype] = None
        read = layout(owner, output, tape.batch, owner.name in self.batch_major)
        if read == TIME_MAJOR and ambiguous(output, tape.batch):
            tape.ambiguous[owner.name] = tuple(output.shape[:2])
        tape.owners.append(owner)
        tape.layouts.append(read)
        use = tape.calls[id(owner)] = tape.calls.get(id(owner), 0) + 1
        if use > 1 and tape.streams.get(id(owner), (None,))[0] is not None:  # its values: once per forward pass
            tape.repeated.append(owner)
        streamed = streams(tape, owner, output)
        tape.streamed.append(streamed)
        if streamed:
            probes = self.probes(tape, owner, _shapes(tape, owner, output, saved), use)
            tape.saved.append(None)
            tape.probes.append(probes)
            return _Stream.apply(output, saved, functools.partial(self.reduce, tape, owner, read), *probes)
        # a shared output (`SHARED`) comes out broadcast to B rows: each sample's copy gets its own gradient
        shape = output.shape
        if read == SHARED and self.broadcast:
            shape = (tape.batch, *output.shape[1:])
            tape.broadcast.append(owner.name)
        probes = self.probes(tape, owner, [(shape, output.dtype)], use)
        tape.saved.append(saved)
        tape.probes.append(probes)
        return output + probes[0]

    def replayed(self, tape: Tape, owner: Owner, mod, args, kwargs, output):
        """A layer the fallback replays (`dpmem.persample.fallback`): its call kept, and a zero added to each output
        leaf that asks a per-sample gradient (one shared by the batch broadcast to B rows); never streamed."""
        check_deterministic(owner.name, mod)
        leaves, spec = tree_flatten(output)
        replay = replay_of(mod)
        dims = (replay.dims if replay is not None else leading_dims)(owner.name, mod, args, kwargs, leaves, tape.batch)
        asked = [j for j, d in enumerate(dims[1]) if d is not None]
        shapes = []
        for j in asked:
            t, d = leaves[j], dims[1][j]
            tape.dtypes[t.dtype] = None
            shape = list(t.shape)
            if self.broadcast and shape[d] != tape.batch:  # a leaf shared by the batch (one row) comes out with B
                shape[d] = tape.batch
                tape.broadcast.append(owner.name)
            shapes.append((torch.Size(shape), t.dtype))
        tape.owners.append(owner)
        shared = tuple(leaves[j].shape[dims[1][j]] == 1 < tape.batch for j in asked)
        tape.layouts.append((*dims[1], *shared))  # its batch dimensions and shared leaves
        use = tape.calls[id(owner)] = tape.calls.get(id(owner), 0) + 1
        tape.streamed.append(False)
        probes = self.probes(tape, owner, shapes, use)
        tape.saved.append((capture_call(mod, args, kwargs, output), dims))
        tape.probes.append(probes)
        for j, probe in zip(asked, probes):
            leaves[j] = leaves[j] + probe
        return tree_unflatten(leaves, spec) if not isinstance(output, torch.Tensor) else leaves[0]

    def probes(self, tape: Tape, owner: Owner, shapes: list, use: int) -> list[torch.Tensor]:
        """The zeros of a layer's `use`-th call in the forward pass (each call its own: autograd sums what two
        calls send one tensor), of `shapes` ((shape, dtype) each)."""
        leaf = tape.leaf
        if tape.in_graph:  # made in the graph: one made outside is an autograd edge dynamo refuses there
            return [tape.zeros_like(shape, dtype) for shape, dtype in shapes]
        key = (id(owner), use, *shapes)
        made = self.zeros.get(key)
        if made is None or made[0] is not leaf:
            if torch.compiler.is_compiling():  # a compiled forward's own would be outputs, not what autograd reaches
                raise RuntimeError("a compiled forward's probes are made by an eager forward of its shapes first")
            with torch.enable_grad():
                made = self.zeros[key] = (leaf, [leaf.to(dtype).expand(shape) for shape, dtype in shapes])
        return made[1]

    @staticmethod
    def reduce(tape: Tape, owner: Owner, read, saved, grad_output: torch.Tensor) -> list[torch.Tensor]:
        """A streamed layer's reducers' values, inside the backward pass, as tensors in its probes' order, or its pair
        (output gradient, input); None after the first backward pass."""
        kinds = tape.streams[id(owner)][0]
        if not tape.armed:
            return [None] * (2 if kinds is None else len(kinds))
        if kinds is None:
            return [grad_output, saved]
        with memory_label("per_sample"), exact_float32(grad_output.device):
            grads = rule_gradients(owner, saved, grad_output, tape.batch, read)
            return [stream.kept(grads[name]) for stream, name in zip(kinds, owner.params)]


def _shapes(tape: Tape, owner: Owner, output: torch.Tensor, saved: torch.Tensor) -> list:
    """A streamed use's probes' (shape, dtype): its values', or its pair's (output gradient, input)."""
    return tape.streams[id(owner)][1] or [(output.shape, output.dtype), (saved.shape, saved.dtype)]


def streams(tape: Tape, owner: Owner, output: torch.Tensor) -> bool:
    """Whether this use of a layer streams (its values or its pair): where it can, and only where its output
    gradient is large enough for the memory to matter (`Tape.min_elements`); the same in a checkpoint's recompute,
    which sees the same shapes."""
    shared = output.dim() and output.shape[0] == 1 < tape.batch  # `SHARED`: broadcast whole, never streamed
    return id(owner) in tape.streams and output.numel() >= tape.min_elements and not shared


class InnerCall(TorchFunctionMode):
    """Active during the forward of a subclass whose forward is its own (`registry.inner_call`): where that forward
    calls its rule's function on the layer's weight (F.embedding in Gemma's scaled word embedding and OPT's
    positions), the call's result is tapped (`tap(result, the call's input)`), so the subclass's code around the
    call (a scaling by √d) lies between the tap and the loss, where autograd differentiates it."""

    def __init__(self, owner: Owner, tap: Callable):
        super().__init__()
        self.owner, self.tap, self.made = owner, tap, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rule = self.owner.rule
        if func is rule.call:
            weight = args[rule.weight_at] if len(args) > rule.weight_at else kwargs.get("weight")
            if weight is self.owner.module.weight:
                self.made += 1
                return self.tap(out, args[0] if args else kwargs["input"])
        return out


class _Stream(torch.autograd.Function):
    """The identity on a layer's output that saves the layer's input (what its rule keeps) for the backward pass,
    where `reduce(input, output gradient)` gives the layer's reduced values (or its pair): the gradients of
    `probes`. A saved tensor, unlike a Python reference, is what activation checkpointing drops after the forward
    and recomputes in the backward. `reduce` None: a recompute, which only saves again what the forward saved.

    The output is a detached alias of the layer's output: a new autograd output, not a view of an input, so later
    in-place ops on it stay legal (marking it dirty made autograd treat it as a modified view of the matmul's
    result, and every backward copied each output gradient four times)."""

    @staticmethod
    def forward(ctx, output, saved, reduce, *probes):
        ctx.save_for_backward(saved)
        ctx.reduce = reduce
        return output.detach()

    @staticmethod
    def backward(ctx, grad_output):
        return (grad_output, None, None, *ctx.reduce(ctx.saved_tensors[0], grad_output))


class _Recording:
    """`with taps.recording(...) as tape:` (a class, not a generator: dynamo traces it plainly)."""

    def __init__(self, taps: Taps, *args):
        self.taps, self.args = taps, args

    def __enter__(self) -> Tape:
        return self.taps.start(*self.args)

    def __exit__(self, *exc) -> None:
        self.taps._hooks.tape = None  # recording stops
        self.taps._hooks.abandon()  # none left in a forward that ended; one that raised may leave some
