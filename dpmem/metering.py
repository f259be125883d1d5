"""What a run measures besides its metric: `Meter`, its peak memory and training throughput; and the live-tensor
counter it reads on the CPU and meta (on CUDA, the allocator's peaks): a TorchDispatchMode that counts the bytes of
live tensor storages, exact and device-independent, and says what they were at the peak, by CATEGORIES, which
`memory_label` assigns (and the counter itself, for gradients and correlated noise's buffers)."""

from __future__ import annotations

import contextlib
import contextvars
import time
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dpmem import sharding

CATEGORIES = ("parameters", "gradients", "per_sample", "optimizer_state", "noise_buffers", "activations", "temporaries")
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
    the peak counts as a gradient, and one that correlated noise keeps (bandmf's last b − 1 noise vectors) as a noise
    buffer, whatever made it."""

    def __init__(self, block: int = 1):
        super().__init__()
        self.block = block
        self._live: dict[int, tuple[weakref.ref, int, str]] = {}
        self._params: list[torch.nn.Parameter] = []
        self._noise = None  # the method's correlated noise (`dpmem.privacy.correlated.CorrelatedNoise`), if any
        self.current = self.peak = 0
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak_breakdown = dict.fromkeys(CATEGORIES, 0)

    def track(self, tensors: Iterable[torch.Tensor], category: str = "parameters") -> "LiveTensorCounter":
        for t in tensors:
            self._add(t, category)
        return self

    def track_state(self, model: torch.nn.Module, method=None) -> "LiveTensorCounter":
        """Everything that exists between steps: parameters and buffers, gradients, the method's optimiser state
        and its mechanism's noise buffers."""
        self._params = list(model.parameters())
        self.track(self._params).track(model.buffers())
        self.track((p.grad for p in self._params if p.grad is not None), "gradients")
        noise = getattr(getattr(method, "mechanism", None), "correlated", None)
        self.track(noise.tensors() if noise is not None else [], "noise_buffers")
        self._noise = noise
        return self.track(method.state_tensors() if method is not None else [], "optimizer_state")

    def _add(self, t, category: str) -> None:
        if isinstance(t, torch.Tensor) and not t.is_sparse:  # an FSDP shard: what this rank holds
            self._add_storage(sharding.local(t).untyped_storage(), category)

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
        if self._noise is not None:
            self._keep_noise()
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

    def _keep_noise(self) -> None:
        """A release draws each noise vector as a temporary; one that correlated noise keeps counts as a noise buffer
        from then until it dies. Each run's vectors are newest first, and those made before the count are tracked
        as noise buffers (`track_state`): the ones kept since the last peak come before the first already counted,
        so a peak reads a few per run, not all b − 1 (OPT-6.7B's release has 400 runs)."""
        with torch._C.DisableTorchFunction():
            for kept in self._noise.buffers.values():
                for t in kept:
                    key = id(t.untyped_storage())
                    entry = self._live.get(key)
                    if entry is None or entry[2] == "noise_buffers":
                        break
                    self._live[key] = (entry[0], entry[1], "noise_buffers")
                    self.by_category[entry[2]] -= entry[1]
                    self.by_category["noise_buffers"] += entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = _label.get()
        for t in tree_flatten(out)[0]:
            self._add(t, category)
        return out


class Meter:
    """Peak memory: CUDA's allocator statistics, or on CPU/meta the live-tensor counter over `memory_steps` steps
    (it slows every op). Metering starts at the second step: the first runs a one-off attribution proof that keeps the
    batch gradient. Throughput: samples per second of training, evaluation time left out."""

    def __init__(self, device: torch.device, steps: int, memory_steps: int, first: int = 1):
        """`first`: the first step (0-based) metered, at least 1; bandmf holds all its b − 1 buffers from step b − 1."""
        self.device = device
        self.start = min(max(1, first), steps - 1) if steps > 1 else 0
        self.stop = self.start + memory_steps
        self.counter: LiveTensorCounter | None = None
        self.peak: int | None = None
        self._began, self._paused = time.perf_counter(), 0.0

    def step_begins(self, step: int, model, method) -> None:
        if step != self.start:
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.stop > self.start:
            self.counter = LiveTensorCounter().track_state(model, method)
            self.counter.__enter__()

    def step_ends(self, step: int) -> None:
        if self.counter is not None and step + 1 == self.stop:
            self.close()

    def close(self) -> None:
        """Stop the counter (at the end of the metered steps, or when the run ends before)."""
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.peak, self.counter = self.counter.peak, None

    @contextlib.contextmanager
    def paused(self):
        """Time inside (evaluation) does not count as training time."""
        tic = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - tic

    def throughput(self, samples: int) -> float:
        return samples / max(time.perf_counter() - self._began - self._paused, 1e-9)

    def fields(self) -> dict:
        """The summary's memory fields as measured so far (none before the first measurement)."""
        if self.device.type == "cuda":
            return {"peak_memory_bytes": torch.cuda.max_memory_reserved(self.device),
                    "peak_memory_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                    "peak_memory_source": "cuda_max_reserved"}
        if self.peak is not None:
            return {"peak_memory_bytes": self.peak, "peak_memory_source": "live_tensors"}
        return {}
