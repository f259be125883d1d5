"""Capture by callbacks: layer inputs in the forward pass, output gradients as the backward pass reaches each layer,
each pair turned into per-sample gradients with the rule of the layer's type and reduced at once. Vectorised over
the batch; no loop over samples.

The private step itself captures by `dpmem.persample.taps` (values returned to the step, which compiles). These
callbacks serve what must act inside the backward pass: two-pass clipping (each layer's norm made and its output
gradient freed as the backward reaches it), activation checkpointing (the recompute saves the layer's input again
inside the backward), FSDP (the parameters' gathered stand-ins), and the spectrum analysis."""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import nn

from dpmem.metering import memory_label
from dpmem.precision import Compute, exact_float32, tf32_enabled
from dpmem.persample.fallback import capture_call, check_deterministic, fallback_grads
from dpmem.persample.reducers import Reducer, materialize
from dpmem.persample.owners import (Owner, batch_first, enter_scope, find_owners, leave_scope, owned_parameters,
                                    tied_sum)


def weakly(method: Callable) -> Callable:
    """A hook that calls a bound `method` while its object lives. Hooks live as long as the model; holding their
    owner strongly would keep every owner alive (and its hooks firing) for as long as the model is."""
    ref = weakref.WeakMethod(method)

    def hook(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    return hook


def remove_handles(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class PerSampleGradients:
    """Per-sample gradients of every trainable parameter of `model`, reduced one parameter at a time.

    `with psg.capture(batch_size, reducers) as kept:` around a forward and backward of a *summed* per-sample loss
    leaves in `kept` one entry per parameter: its reducer (`dpmem.persample.reducers`; `materialize`, dense
    (B, *shape) tensors, for any parameter not in `reducers`) applied to its per-sample gradient as soon as its
    last use has arrived. A parameter used by several modules (tied weights) is reduced as the sum over every
    use. The layer's factors are freed then, unless the reducer keeps them (book-keeping).

    Its hooks are removed by `close()` (or `with PerSampleGradients(model) as psg:`), and when it is garbage-
    collected; several objects on one model do not interfere, since each one's hooks act only inside its capture.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._active = False
        self._reducers: dict[nn.Parameter, Reducer] = {}
        self._pending: dict[nn.Parameter, Any] = {}  # per-sample gradients of parameters with uses still to come
        self._kept: dict[nn.Parameter, Any] = {}  # what the reducers returned
        self._uses: dict[nn.Parameter, int] = {}  # forward uses of each parameter in this capture
        self._skipping = False  # inside a capture without batch gradients
        self._graph = False  # the last forward pass was inside a capture (see `_acting`)
        self._replaying = False
        self._arrived: dict[nn.Parameter, int] = {}  # backward hooks seen per parameter
        self._owners = find_owners(model)
        self.compute = Compute()  # what the last capture's backward computed in (the coverage check's tolerance)
        # what capture(batch_gradients=False) turns off: the parameters of float-input rules. One also owned by a
        # rule whose input is not (an embedding's ids cannot carry a gradient to its hook; a tied head) keeps
        # requires_grad; so do the fallback's
        keep = {p for o in self._owners if o.rule is None or not o.rule.float_input for p in o.params.values()}
        self._float_input_params = list(dict.fromkeys(p for o in self._owners for p in o.params.values()
                                                      if p not in keep))
        # a leaf that every rule's output node points to: a backward pass to it alone reaches every hooked layer's
        # output gradient and computes no parameter's batch gradient (`backward_to_hooks`). The fallback's
        # outputs carry plain tensor hooks, which such a pass may not reach.
        self._anchor = torch.zeros(0, device=self._device, requires_grad=True)
        self.anchored = all(o.rule is not None for o in self._owners)
        self._handles: list = []
        self._close = weakref.finalize(self, remove_handles, self._handles)
        for owner in self._owners:
            owner.on_grad = functools.partial(weakly(self._accumulate), owner)
            self._handles.append(owner.module.register_forward_pre_hook(
                functools.partial(weakly(self._pre_hook), owner), with_kwargs=True))
            self._handles.append(owner.module.register_forward_hook(
                functools.partial(weakly(self._post_hook), owner), with_kwargs=True))

    @property
    def parameters(self) -> list[nn.Parameter]:
        return owned_parameters(self._owners)

    @property
    def _device(self) -> torch.device:
        return next((p.device for o in self._owners for p in o.params.values()), torch.device("cpu"))

    @contextlib.contextmanager
    def capture(self, batch_size: int, reducers: dict[nn.Parameter, Reducer] | None = None,
                batch_gradients: bool = True):
        """Hooks are live inside; `batch_size` is the number of samples in the forward pass. Yields the dict that
        holds each parameter's reduced per-sample gradient once the block is done (in the order their last uses
        arrived).

        `batch_gradients=False`: the forward inside runs with the parameters of float-input layer rules (linear,
        conv, LayerNorm) not requiring grad, so the backward does not form autograd's batch gradient of those
        weights (the m×n product per layer that private training drops anyway); their per-sample gradients come
        from the hooks as before. A layer whose input then requires no grad gets a grad-requiring view of it, so
        that its output gradient still reaches the hook."""
        self._active, self._batch, self._reducers = True, batch_size, reducers or {}
        self._uses, self._arrived, self._pending, self._kept = {}, {}, {}, {}
        self.compute = Compute(tf32=tf32_enabled(self._device))
        skipped = [] if batch_gradients else self._without_batch_gradients()
        try:
            # a checkpoint's recompute runs whole, so that every hook that enters a scope also leaves it
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                yield self._kept
            with memory_label("per_sample"), exact_float32(self._device):
                for p in list(self._pending):  # uses whose output got no gradient
                    self._reduce(p)
        finally:
            self._active, self._skipping, self._reducers, self._pending = False, False, {}, {}
            self._kept = {}
            for p in skipped:
                p.requires_grad_(True)

    def _without_batch_gradients(self) -> list[nn.Parameter]:
        """Turn requires_grad off for the parameters only float-input rules own; returns them, to be turned back on."""
        skipped = [p for p in self._float_input_params if p.requires_grad]
        for p in skipped:
            p.requires_grad_(False)
        self._skipping = bool(skipped)
        return skipped

    def backward_to_hooks(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """`loss.backward()` as far as the hooks need: every hooked layer's output gradient, and no parameter's
        batch gradient (autograd leaves out their products: two-pass clipping's first pass needs norms only).
        A plain backward pass where a fallback module owns parameters."""
        if self.anchored:
            torch.autograd.backward(loss, inputs=[self._anchor], retain_graph=retain_graph)
        else:
            loss.backward(retain_graph=retain_graph)

    def close(self) -> None:
        """Remove every hook from the model (idempotent)."""
        self._close()

    def __enter__(self) -> "PerSampleGradients":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- hooks -------------------------------------------------------------------------------------------
    def _acting(self) -> bool:
        """Whether the hooks act on this forward: one inside `capture`, or activation checkpointing's recompute
        (it runs inside a backward pass) of one that was, which must save what that forward saved."""
        if self._replaying:  # the fallback's replay of a module
            return False
        if not _in_backward():  # a forward pass proper, not a recompute
            self._graph = self._active
        return self._graph

    def _pre_hook(self, owner: Owner, mod, args, kwargs):
        if not self._acting():
            return None
        if owner.rule is not None and owner.rule.scope is not None:
            enter_scope(owner, mod)
        if (self._skipping and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()
                and not args[0].requires_grad and not any(p.requires_grad for p in owner.params.values())):
            # nothing upstream needs a gradient: a grad-requiring view carries this layer's output gradient
            return (args[0].detach().requires_grad_(), *args[1:]), kwargs
        return None

    def _post_hook(self, owner: Owner, mod, args, kwargs, output):
        if not self._acting():
            return None
        rule, scope = owner.rule, leave_scope(owner, mod, output)
        if not output.requires_grad:
            return None
        recompute = _in_backward()
        if self._active and not recompute:
            for p in owner.params.values():
                self._uses[p] = self._uses.get(p, 0) + 1
        if rule is None:  # replayed, not recomputed: its call is kept by reference from the forward proper
            if not recompute:
                check_deterministic(owner.name, mod)
                saved = capture_call(mod, args, kwargs, output, None)
                output.register_hook(lambda g: owner.on_grad(saved, g))
            return None
        saved = rule.capture(mod, args, kwargs, output, scope).detach()  # kept by the backward, not part of it
        return _KeepInput.apply(output, saved, owner.on_grad, self._anchor)

    def _accumulate(self, owner: Owner, saved, grad_output: torch.Tensor) -> None:
        if not self._active:  # a second backward through this graph (two-pass clipping) happens outside `capture`
            return
        self.compute = self.compute.lowered(grad_output.dtype)
        with memory_label("per_sample"), exact_float32(grad_output.device):
            self._per_sample(owner, saved, grad_output)

    def _per_sample(self, owner: Owner, saved, grad_output: torch.Tensor) -> None:
        saved, grad_output = batch_first(owner, saved, grad_output, self._batch)
        if owner.rule is None:
            self._replaying = True  # the replay calls submodules whose hooks must not fire
            try:
                grads = fallback_grads(owner.module, list(owner.params), saved, grad_output)
            finally:
                self._replaying = False
        else:
            grads = owner.rule.gradients(owner.module, saved, grad_output)
        for name, g in grads.items():
            p = owner.params.get(name)
            if p is None:  # a frozen parameter of a rule-covered module
                continue
            self._pending[p] = g if p not in self._pending else tied_sum(self._pending[p], g)
            self._arrived[p] = self._arrived.get(p, 0) + 1
            if self._arrived[p] == self._uses.get(p, 0):  # every use is in: reduce it, free the rest
                self._reduce(p)

    def _reduce(self, p: nn.Parameter) -> None:
        self._kept[p] = self._reducers.get(p, materialize)(self._pending.pop(p))


def _in_backward() -> bool:
    """Inside autograd's backward pass: a forward running there is activation checkpointing's recompute."""
    return torch._C._current_graph_task_id() != -1


class _KeepInput(torch.autograd.Function):
    """The identity on a layer's output that keeps the layer's captured input (or ids) as an autograd saved
    tensor and hands it, with the output's gradient, to `on_grad` in the backward pass. A saved tensor, unlike a
    Python reference, is what activation checkpointing drops after the forward and recomputes in the backward
    (the recompute runs the hooks again, which save it again).

    The output is returned as a detached alias of the layer's output: a new autograd output, not a view of an
    input, so later in-place ops on it stay legal. Marking the output dirty instead (an in-place identity) made
    autograd treat the layer's output, itself a view of the matmul's 2-D result, as a modified view: every
    backward then cloned and copied each layer's output gradient four times (CopySlices). The alias shares the output's version counter; the rules' layers do not save their
    own outputs, so an in-place op on it invalidates nothing they need."""

    @staticmethod
    def forward(ctx, output, saved, on_grad, anchor):
        ctx.save_for_backward(saved)
        ctx.on_grad = on_grad
        return output.detach()

    @staticmethod
    def backward(ctx, grad_output):
        ctx.on_grad(ctx.saved_tensors[0], grad_output)
        return grad_output, None, None, None
