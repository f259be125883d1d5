"""Memory and throughput meters. On CUDA the allocator's peaks; elsewhere (CPU, meta) a TorchDispatchMode that
counts the bytes of live tensor storages, which is exact and device-independent, and says what they were at the
peak: parameters, gradients, per-sample state, optimiser state, activations and temporaries."""

from __future__ import annotations

import contextvars
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dpmem import sharding

CATEGORIES = ("parameters", "gradients", "per_sample", "optimizer_state", "activations", "temporaries")
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of 512 bytes

# What the code running now is making; storages created under no label are temporaries. A context variable, so
# that labelling costs nothing when no counter is active and nested labels unwind on exceptions.
_label: contextvars.ContextVar[str] = contextvars.ContextVar("dpmem_memory_label", default="temporaries")


class memory_label:
    """Storages created inside count as `category` (one of CATEGORIES) in a LiveTensorCounter's breakdown. A class,
    not a generator context: it is entered per layer in the backward pass, where each microsecond is host time."""

    __slots__ = ("category", "token")

    def __init__(self, category: str):
        self.category = category

    def __enter__(self) -> None:
        if not torch.compiler.is_compiling():  # a compiled step is not metered by labels (nor planned)
            self.token = _label.set(self.category)

    def __exit__(self, *exc) -> None:
        if not torch.compiler.is_compiling():
            _label.reset(self.token)


def labelled_forward(loss_fn):
    """`loss_fn` with what its forward pass creates (and autograd saves) counted as activations."""
    def forward(model, batch):
        with memory_label("activations"):
            return loss_fn(model, batch)
    return forward


class LiveTensorCounter(TorchDispatchMode):
    """Counts the bytes of every storage an op creates while the mode is active, until that storage dies.
    `track`/`track_state` add storages made before (parameters, optimiser state). `current` and `peak` are in
    bytes, each storage rounded up to a multiple of `block` (1: exact bytes; CUDA_BLOCK: what CUDA's allocator
    would hand out). `peak_breakdown` splits the peak by category; a storage that is some parameter's `.grad` at
    the peak counts as a gradient whatever made it."""

    def __init__(self, block: int = 1):
        super().__init__()
        self.block = block
        self._live: dict[int, tuple[weakref.ref, int, str]] = {}
        self._params: list[torch.nn.Parameter] = []
        self.current = 0
        self.peak = 0
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak_breakdown = dict.fromkeys(CATEGORIES, 0)

    def track(self, tensors: Iterable[torch.Tensor], category: str = "parameters") -> "LiveTensorCounter":
        for t in tensors:
            self._add(t, category)
        return self

    def track_state(self, model: torch.nn.Module, method=None) -> "LiveTensorCounter":
        """Everything that exists between steps: parameters and buffers, gradients, the method's optimiser state."""
        self._params = list(model.parameters())
        self.track(self._params).track(model.buffers())
        self.track((p.grad for p in self._params if p.grad is not None), "gradients")
        return self.track(method.state_tensors() if method is not None else [], "optimizer_state")

    def _add(self, t, category: str) -> None:
        if not isinstance(t, torch.Tensor) or t.is_sparse:
            return
        self._add_storage(sharding.local(t).untyped_storage(), category)  # an FSDP shard: what this rank holds

    def _add_storage(self, storage, category: str) -> None:
        key = id(storage)
        if key in self._live:
            return
        size = self._rounded(storage)
        self._live[key] = (weakref.ref(storage, lambda _, key=key: self._free(key)), size, category)
        self._grow(size, category)

    def _rounded(self, storage) -> int:
        return -(-storage.nbytes() // self.block) * self.block

    def _grow(self, size: int, category: str) -> None:
        self.current += size
        self.by_category[category] += size
        if self.current > self.peak:
            self._new_peak()

    def _resized(self, storage) -> None:
        """A storage resized in place: FSDP frees a gathered parameter by resizing its storage to 0 and gathers it
        again into the same storage, which no op reports."""
        entry = self._live.get(id(storage))
        if entry is None:  # made before the count began (freed then), allocated again now
            return self._add_storage(storage, _label.get())
        ref, size, category = entry
        new = self._rounded(storage)
        self._live[id(storage)] = (ref, new, category)
        self._grow(new - size, category)

    def __enter__(self):
        self._resize = resize = torch.UntypedStorage.resize_

        def resized(storage, size):
            out = resize(storage, size)
            self._resized(storage)
            return out
        torch.UntypedStorage.resize_ = resized
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]
            self.by_category[entry[2]] -= entry[1]

    def _new_peak(self) -> None:
        self.peak = self.current
        breakdown = dict(self.by_category)
        # storages, not gradients: FSDP's gradient shards can be views of one reduce-scatter buffer. Read without
        # torch-function modes: a plan's modes would see every `.grad` read, at every new peak (half a plan's time)
        with torch._C.DisableTorchFunction():
            grads = {id(sharding.local(p.grad).untyped_storage()) for p in self._params if p.grad is not None}
        for key in grads:
            entry = self._live.get(key)
            if entry is not None and entry[2] != "gradients":
                breakdown[entry[2]] -= entry[1]
                breakdown["gradients"] += entry[1]
        self.peak_breakdown = breakdown

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = _label.get()
        for t in tree_flatten(out)[0]:
            self._add(t, category)
        return out
