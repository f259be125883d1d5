"""The state a compiled private step keeps between steps (train.compile, `Privatizer.compile`), apart from the eager
step's: what was compiled, what the first (eager) step taught it, and the flat clipped sum awaiting its release.
The noise's own state (its draws, correlated noise's buffers) is the mechanism's (`GaussianMechanism.state`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompiledStep:
    microbatch: object = None  # the micro-batch, compiled whole (one-pass and two-pass clipping)
    forward: object = None  # or a checkpointed model's forward (or a TF32 run's), compiled alone with its taps
    streamed: str = "values"  # what streams out of the backward: "pairs" in a compiled TF32 one
    copy_first: bool = False  # the compiler reuses its outputs (CUDA graphs): the first micro-batch's sum is copied
    probes_made: bool = False  # an eager forward has made the compiled forward's probes
    probe_shapes: list | None = None  # each parameter's probe draws' (shape, dtype), in order (dp-sgd-rc)
    sum_shapes: list[torch.Size] | None = None  # each clipped sum's shape, in the parameters' order
    flat: torch.Tensor | None = None  # the step's clipped sums, one flat tensor, until released
