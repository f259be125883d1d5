"""The Gaussian mechanism of every first-order private method (REFERENCE §2.1, flat clipping):

    G̃ = ( Σᵢ min(1, C/‖gᵢ‖)·gᵢ + N(0, σ²C² I) ) / (q·n)

where gᵢ is sample i's gradient over all trainable parameters (projected ones as DP-GRAPE projects them).
Clipped sums accumulate over physical micro-batches; the noise is drawn once per logical step.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dpmem.methods.base import Noise, batch_size
from dpmem.persample import PerSampleGradients, clip_factors, per_sample_norms, verify_coverage, weighted_sum


class Privatizer:
    def __init__(self, model: nn.Module, noise: Noise, check_coverage: bool = True):
        self.model, self.noise = model, noise
        self.persample = PerSampleGradients(model)
        self.params = self.persample.parameters
        self._check_coverage = check_coverage
        # autograd's batch gradient is a by-product of the backward pass: drop each as soon as it is made
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._drop_grad)

    def _drop_grad(self, p: nn.Parameter) -> None:
        if not self._check_coverage:
            p.grad = None

    def __call__(self, microbatches, loss_fn, shapes: dict[nn.Parameter, torch.Size],
                 coverage_transform: Callable | None = None) -> tuple[dict[nn.Parameter, torch.Tensor], torch.Tensor]:
        """The privatised gradient (of shape `shapes[p]` per parameter) and the summed per-sample loss."""
        summed = {p: torch.zeros(shapes[p], device=p.device, dtype=p.dtype) for p in self.params}
        loss_sum = torch.zeros((), device=self.params[0].device)
        for mb in microbatches:
            with self.persample.capture(batch_size(mb)):
                losses = loss_fn(self.model, mb)
                losses.sum().backward()
            grads = self.persample.grads
            if self._check_coverage:
                self._check_coverage = False
                verify_coverage(self.model, self.params, grads, coverage_transform)
            factors = clip_factors(per_sample_norms(grads), self.noise.max_grad_norm)
            for p, g in weighted_sum(grads, factors).items():
                summed[p] += g
            self.persample.clear()
            loss_sum = loss_sum + losses.detach().sum()
        std = self.noise.sigma * self.noise.max_grad_norm
        for p in self.params:
            if std > 0:  # sigma = 0 only for privacy=none: clipping without noise
                summed[p] += std * torch.randn(summed[p].shape, generator=self.noise.generator, device=p.device,
                                               dtype=p.dtype)
            summed[p] /= self.noise.expected_batch_size
        return summed, loss_sum
