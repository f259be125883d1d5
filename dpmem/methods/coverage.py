"""The private methods' check, on the first micro-batch, that the per-sample gradients add up to autograd's batch
gradient: a parameter also used outside the module that owns it would otherwise be under-clipped."""

from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import nn

from dpmem import distributed, sharding
from dpmem.precision import Compute

ROUNDING_BAND = 8  # differences up to this many tolerances are rounding that ran long, not a missing use


def verify_coverage(model: nn.Module, params: list[nn.Parameter], totals: dict[nn.Parameter, torch.Tensor],
                    transform: Callable[[nn.Parameter, torch.Tensor], torch.Tensor] | None = None,
                    compute: Compute = Compute()) -> None:
    """While autograd's batch gradients are still in `.grad`: the per-sample gradients' sums `totals` (Σᵢ gᵢ per
    parameter) must equal them (after `transform`, e.g. a projection). Clears the `.grad`s; skipped on meta.

    The two are compared in float32 to the rounding `compute` allows (the backward's dtype and TF32: the batch
    gradient comes out of the model's own matmuls, the sums out of full-float32 ones). A difference within a few
    times that is reported as rounding (a warning); only a larger one blames the module."""
    pairs = [(p, p.grad, totals.get(p)) for p in params]
    for p in params:
        p.grad = None
    if not params or params[0].device.type == "meta":
        return
    if any(sharding.is_sharded(g) for _, g, _ in pairs):  # FSDP: the batch gradient is the sum over the ranks
        distributed.sum_(t for _, _, t in pairs if t is not None)
        pairs = [(p, None if g is None else sharding.full(g), t) for p, g, t in pairs]
    names = {p: n for n, p in model.named_parameters()}
    # a batch gradient rounds its inputs (TF32) or its output (bf16) once; float32 sums of thousands of terms in
    # other orders differ by up to 1e-3 elementwise
    tol = max(4 * compute.unit_roundoff, 1e-3)
    # gradients that vanish analytically (attention key biases) are compared against the scale of the whole
    # gradient, not their own
    scale = max((float(b.abs().max()) for _, b, _ in pairs if b is not None), default=0.0)
    for p, batch_grad, total in pairs:
        if batch_grad is None or total is None:
            continue
        want = (transform(p, batch_grad) if transform is not None else batch_grad).float()
        total = total.float()
        if torch.allclose(total, want, rtol=tol, atol=0.1 * tol * scale):
            continue
        gap = float((total - want).norm() / want.norm().clamp_min(0.1 * tol * scale))
        if gap <= ROUNDING_BAND * tol:
            print(f"dpmem: warning: the per-sample gradients of {names[p]} sum to its batch gradient to {gap:.1e} "
                  f"(relative), more than {compute.name} rounding's usual {tol:.1e} but of its size: rounding, not a "
                  "use outside its module; training goes on", file=sys.stderr)
            continue
        raise RuntimeError(f"per-sample gradients of {names[p]} do not sum to its batch gradient (relative "
                           f"difference {gap:.1e}; {compute.name} rounding explains up to {ROUNDING_BAND * tol:.1e}): "
                           "it is used outside the module that owns it; add a rule for that module")
