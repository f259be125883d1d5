"""What a run measures besides its metric: peak memory and training throughput."""

from __future__ import annotations

import contextlib
import time

import torch

from dpmem.metering import LiveTensorCounter


class Meter:
    """Peak memory: CUDA's allocator statistics, or on CPU/meta the live-tensor counter over `memory_steps` steps
    (it slows every op). Metering starts at the second step: the first runs a one-off coverage check that keeps the
    batch gradient. Throughput: samples per second of training, evaluation time left out."""

    def __init__(self, device: torch.device, steps: int, memory_steps: int):
        self.device = device
        self.start, self.stop = min(1, steps - 1), min(1, steps - 1) + memory_steps
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
