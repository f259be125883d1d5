"""Per-sample capture that returns values, so that the private step is ordinary tensor code and compiles whole.

Each covered layer gets one forward hook (a "tap") that, inside `Taps.recording`, writes what its rule needs (its
input, or an embedding's ids) onto the step's `Tape` and adds a zero probe to its output: an expanded view of one
scalar leaf, so it costs no memory and changes no value. The layers' output gradients are then the gradients of the
summed per-sample loss with respect to the probes, returned by one `torch.autograd.grad` call that computes no
parameter's batch gradient (autograd runs only what leads to the probes), and the layer rules, `Factored`, the
reducers, norms and clip factors consume them as returned tensors. Nothing mutates state inside the backward pass,
so `torch.compile(fullgraph=True)` captures forward, per-sample backward and clipping as one graph; eager and
compiled steps are the same code.

The scalar leaf is made outside any compiled region (dynamo makes no grad-requiring tensor) and passed in. A
probe is a separate autograd node, so a later in-place op on the layer's output changes nothing of its gradient."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
from torch import nn

from dpmem.metering import memory_label
from dpmem.persample.fallback import capture_call, check_deterministic, fallback_grads
from dpmem.persample.owners import (Owner, batch_first, enter_scope, find_owners, leave_scope, owned_parameters,
                                    tied_sum)
from dpmem.persample.reducers import Reducer, materialize
from dpmem.precision import Compute, exact_float32, tf32_enabled


class Tape:
    """One forward pass's records, in call order: the layer (a shared one once per use), what its rule keeps, and
    the probe added to its output."""

    def __init__(self, zero: torch.Tensor):
        self.zeros = {zero.dtype: zero}  # the leaf, and its casts to the outputs' dtypes (one op per dtype)
        self.owners: list[Owner] = []
        self.saved: list[Any] = []
        self.probes: list[torch.Tensor] = []


class Taps:
    """Per-sample gradients of every trainable parameter of `model`, as values:

        with taps.recording(zero) as tape:
            losses = loss_fn(model, batch)
        kept, batch_grads = taps.per_sample(tape, losses.sum(), batch_size, reducers)

    `kept` holds, per parameter, its reducer (`dpmem.persample.reducers`; `materialize` by default) applied to its
    per-sample gradient summed over every use (a tied weight is one gradient). `zero` is `taps.zero()`, a scalar
    leaf made once outside any compiled function. The hooks act only inside `recording`; `close()` removes them.
    Layer inputs are kept as the forward's own tensors, not detached: what consumes `kept` runs under no_grad."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.owners = find_owners(model)
        self.parameters = owned_parameters(self.owners)
        self.compute = Compute()  # what the last step's backward computed in (the coverage check's tolerance)
        self._tape: Tape | None = None
        self._handles = []
        for owner in self.owners:
            if owner.rule is not None and owner.rule.scope is not None:
                self._handles.append(owner.module.register_forward_pre_hook(
                    functools.partial(self._enter_scope, owner), with_kwargs=True))
            self._handles.append(owner.module.register_forward_hook(
                functools.partial(self._tap, owner), with_kwargs=True))

    def zero(self) -> torch.Tensor:
        """The probes' scalar leaf (float32; each probe takes its output's dtype)."""
        device = self.parameters[0].device
        return torch.zeros((), device=device, requires_grad=True)

    def close(self) -> None:
        """Remove the taps from the model (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "Taps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- recording -----------------------------------------------------------------------------------------
    def start(self, zero: torch.Tensor) -> Tape:
        self._tape = Tape(zero)
        return self._tape

    def stop(self) -> None:
        self._tape = None

    def recording(self, zero: torch.Tensor) -> "_Recording":
        return _Recording(self, zero)

    def _enter_scope(self, owner: Owner, mod, args, kwargs):
        if self._tape is not None:
            enter_scope(owner, mod)

    def _tap(self, owner: Owner, mod, args, kwargs, output):
        tape = self._tape
        if tape is None:
            return None
        rule, scope = owner.rule, leave_scope(owner, mod, output)
        if rule is None:
            check_deterministic(owner.name, mod)
            saved = capture_call(mod, args, kwargs, output, None)
        else:
            saved = rule.capture(mod, args, kwargs, output, scope)
        zero = tape.zeros.get(output.dtype)
        if zero is None:
            zero = tape.zeros[output.dtype] = next(iter(tape.zeros.values())).to(output.dtype)
        probe = zero.expand(output.shape)
        tape.owners.append(owner)
        tape.saved.append(saved)
        tape.probes.append(probe)
        return output + probe

    # -- per-sample gradients -------------------------------------------------------------------------------
    def per_sample(self, tape: Tape, loss: torch.Tensor, batch: int, reducers: dict[nn.Parameter, Reducer],
                   batch_gradients: bool = False) -> tuple[dict, dict]:
        """({parameter: its reducer's value}, {parameter: autograd's batch gradient} if `batch_gradients` (the
        coverage check) else {}), from one backward pass of `loss`, the summed per-sample loss of `batch`
        samples recorded on `tape`. A parameter is reduced once every use's gradient is in (uses taken last to
        first), and each layer's output gradient dropped as soon as its rule has used it."""
        params = self.parameters if batch_gradients else []
        grads = list(torch.autograd.grad(loss, [*tape.probes, *params], allow_unused=True))
        batch_grads = dict(zip(params, grads[len(tape.probes):]))
        del grads[len(tape.probes):]
        self.compute = Compute(tf32=tf32_enabled(loss.device))
        uses = Counter(p for owner in tape.owners for p in owner.params.values())
        pending: dict[nn.Parameter, Any] = {}
        kept: dict[nn.Parameter, Any] = {}
        # no_grad: the rules' products on the kept inputs (not detached: an op fewer per layer) record no graph
        with memory_label("per_sample"), exact_float32(loss.device), torch.no_grad():
            # last use first, the order a backward pass reaches them (and the callbacks reduce them): estimators'
            # probes are drawn in that order
            for i in reversed(range(len(tape.owners))):
                owner = tape.owners[i]
                g, saved = grads[i], tape.saved[i]
                grads[i] = tape.saved[i] = None
                if g is not None:  # None: this use's output did not reach the loss
                    self.compute = self.compute.lowered(g.dtype)
                    for name, part in self._gradients(owner, saved, g, batch).items():
                        p = owner.params.get(name)
                        if p is not None:  # None: a frozen parameter of a rule-covered module
                            pending[p] = part if p not in pending else tied_sum(pending[p], part)
                for p in owner.params.values():
                    uses[p] -= 1
                    if uses[p] == 0 and p in pending:  # every use is in: reduce it, free the rest
                        kept[p] = reducers.get(p, materialize)(pending.pop(p))
        return kept, batch_grads

    @staticmethod
    def _gradients(owner: Owner, saved, grad_output: torch.Tensor, batch: int) -> dict:
        saved, grad_output = batch_first(owner, saved, grad_output, batch)
        if owner.rule is None:
            return fallback_grads(owner.module, list(owner.params), saved, grad_output)
        return owner.rule.gradients(owner.module, saved, grad_output)


class _Recording:
    """`with taps.recording(zero) as tape:` (a class, not a generator: dynamo traces it plainly)."""

    def __init__(self, taps: Taps, zero: torch.Tensor):
        self.taps, self.zero = taps, zero

    def __enter__(self) -> Tape:
        return self.taps.start(self.zero)

    def __exit__(self, *exc) -> None:
        self.taps.stop()
