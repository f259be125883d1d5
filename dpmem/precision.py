"""Compute precision: what a run computes its forward and backward passes in (`train.precision`), and the float32
that the private arithmetic always runs in.

    fp32   float32 everywhere, TF32 off (matmuls and convolutions in full float32)
    tf32   float32 tensors; CUDA matmuls and convolutions round their inputs to TF32's 10-bit mantissa
    bf16   autocast: the forward's matmuls in bfloat16 (so the backward's too); parameters, gradients and
           optimiser state stay float32

Whatever the run's precision, per-sample gradients, their norms, clip factors, clipped sums, the noise, the
privatised gradient and the optimiser state are float32 formed in full float32 (`exact_float32`). With one-pass
clipping a norm is then the norm of exactly what is clipped, to float32 rounding; two-pass clipping's second
backward forms the clipped sum in the compute precision (`tolerance` bounds what that adds). What the compute
precision rounds is the layers' own inputs and output gradients, from which the per-sample gradients are made.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

# each format's significand bits p, the implicit bit counted (TF32 and bfloat16 store 10 and 7)
_SIGNIFICAND_BITS = {torch.float32: 24, torch.float64: 53, torch.float16: 11, torch.bfloat16: 8}
TF32_BITS = 11


def unit_roundoff(dtype: torch.dtype, tf32: bool = False) -> float:
    """The relative error of rounding to the format products are computed from: 2^-p for a p-bit significand. A
    float32 product under TF32 rounds its inputs to 11 bits."""
    return 2.0 ** -(TF32_BITS if tf32 and dtype == torch.float32 else _SIGNIFICAND_BITS[dtype])


def tolerance(dtype: torch.dtype, tf32: bool = False) -> float:
    """The relative difference up to which two results of the same computation, one of them made with products
    in `dtype` (inputs, outputs or both rounded to it), count as equal: 16 unit roundoffs (a product rounds each of
    its two inputs, a sum accumulates, and a backward pass chains layers). bf16 6.3e-2, TF32 7.8e-3, float32 9.5e-7.

    Under two-pass clipping (the module's docstring), ‖clipped gᵢ‖ ≤ C·(1 + tolerance); under one-pass clipping the
    float32 tolerance holds (tests/test_precision.py measures both)."""
    return 16 * unit_roundoff(dtype, tf32)


@dataclass(frozen=True)
class Compute:
    """What a backward pass computed in: the lowest-precision dtype of its layers' output gradients, and whether
    float32 matmuls ran in TF32."""
    dtype: torch.dtype = torch.float32
    tf32: bool = False

    @property
    def name(self) -> str:
        return "tf32" if self.tf32 and self.dtype == torch.float32 else str(self.dtype).removeprefix("torch.")

    @property
    def unit_roundoff(self) -> float:
        return unit_roundoff(self.dtype, self.tf32)

    def lowered(self, dtype: torch.dtype) -> "Compute":
        """This, or `dtype` if that has fewer significand bits."""
        if dtype in _SIGNIFICAND_BITS and _SIGNIFICAND_BITS[dtype] < _SIGNIFICAND_BITS[self.dtype]:
            return Compute(dtype, self.tf32)
        return self


def tf32_enabled(device: torch.device) -> bool:
    """Whether float32 matmuls on `device` run in TF32 now (CUDA only)."""
    return device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32


def exact_float32(device: torch.device):
    """Full float32 inside: autocast off, TF32 off. The private arithmetic runs here. The TF32 switches are
    process-wide; the backward pass runs the taps' reductions that enter this on its own thread while the caller
    waits, and the previous values come back on exit. Entered per layer in the backward pass: when neither is on for
    the device (TF32 is CUDA's alone), nothing is switched, at no context's cost."""
    kind = device.type if device.type in ("cuda", "cpu") else "cpu"
    tf32 = device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
    if not tf32 and not torch.is_autocast_enabled(kind):
        return contextlib.nullcontext()
    if torch.compiler.is_compiling():  # a graph cannot flip the TF32 switches (a TF32 run reduces outside graphs)
        return torch.autocast(kind, enabled=False)
    return _exact_float32(kind)


@contextlib.contextmanager
def _exact_float32(kind: str):
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(kind, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


class RunPrecision:
    """A run's `train.precision` on its device: `with precision:` sets the TF32 switches for the run (and puts
    back what was there); `autocast()` is the context a forward pass runs in."""

    def __init__(self, name: str, device: torch.device):
        self.name, self.device, self.tf32 = name, device, name == "tf32"

    def autocast(self):
        if self.name == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, loss_fn):
        """`loss_fn` with its forward pass under autocast. Only the forward: the backward passes that follow, and
        the private arithmetic in their hooks, run outside it, as torch's autocast recipe has it."""
        if self.name != "bf16":
            return loss_fn

        def autocast_loss(model, batch):
            with self.autocast():
                return loss_fn(model, batch)
        return autocast_loss

    def __enter__(self) -> "RunPrecision":
        self._saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.tf32
        return self

    def __exit__(self, *exc) -> None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._saved


def unsupported(name: str, device: torch.device) -> str | None:
    """Why `device` cannot run `name` (None if it can)."""
    if name == "tf32" and device.type != "cuda":
        return f"tf32 is a mode of CUDA GPUs' matmuls and this run is on {device.type}; allowed there: fp32, bf16"
    if name == "tf32" and torch.cuda.get_device_capability(device)[0] < 8:
        return "tf32 needs a GPU of compute capability 8.0 (Ampere) or newer; allowed on this one: fp32, bf16"
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return "this GPU has no bfloat16 arithmetic; allowed on it: fp32" + (
            ", tf32" if torch.cuda.get_device_capability(device)[0] >= 8 else "")
    if name != "fp32" and device.type not in ("cpu", "cuda"):
        return f"{name} runs on cpu or cuda, not {device.type}; allowed there: fp32"
    return None
