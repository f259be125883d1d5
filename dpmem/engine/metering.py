"""Memory and throughput meters. On CUDA the allocator's peaks; elsewhere (CPU, meta) a TorchDispatchMode that
counts the bytes of live tensor storages, which is exact and device-independent."""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorCounter(TorchDispatchMode):
    """Counts the bytes of every storage an op creates while the mode is active, until that storage dies.
    `track` adds storages made before (parameters, optimiser state). `current` and `peak` are in bytes."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0

    def track(self, tensors: Iterable[torch.Tensor]) -> "LiveTensorCounter":
        for t in tensors:
            self._add(t)
        return self

    def _add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.is_sparse:
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        size = storage.nbytes()
        self._live[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))
        self.current += size
        self.peak = max(self.peak, self.current)

    def _free(self, key: int, size: int) -> None:
        if self._live.pop(key, None) is not None:
            self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._add(t)
        return out


def state_tensors(model: torch.nn.Module, method=None) -> list[torch.Tensor]:
    """Tensors that exist between steps: parameters, buffers, gradients and the method's optimiser state."""
    out = list(model.parameters()) + list(model.buffers())
    out += [p.grad for p in model.parameters() if p.grad is not None]
    return out + (method.state_tensors() if method is not None else [])
