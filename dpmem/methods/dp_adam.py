"""DP-Adam / DP-SGD with flat clipping (REFERENCE §2.1, Algorithm 3):

    G̃ = ( Σᵢ clip(Gᵢ, C) + N(0, σ²C² I) ) / (q·n),   clip(G, C) = min(1, C/‖G‖)·G over all trainable parameters

then the configured optimiser (Adam, AdamW or SGD) steps on G̃. Clipped sums accumulate over micro-batches;
the noise is drawn once per logical step.
"""

from __future__ import annotations

import torch

from dpmem.methods.base import Method, Noise, batch_size, make_optimizer
from dpmem.persample import PerSampleGradients, clip_factors, per_sample_norms, weighted_sum


class DPAdam(Method):
    private = True

    def __init__(self, model, cfg, lr, noise: Noise, seed: int = 0):
        super().__init__(model, cfg, lr)
        self.noise = noise
        self.persample = PerSampleGradients(model)
        self.params = self.persample.parameters
        self.optimizer = make_optimizer(self.params, cfg, lr)
        self._check_coverage = cfg.check_coverage
        # autograd's batch gradient is a by-product of the backward pass: drop each as soon as it is made
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._drop_grad)

    def _drop_grad(self, p: torch.nn.Parameter) -> None:
        if not self._check_coverage:
            p.grad = None

    def step(self, microbatches, loss_fn):
        summed = {p: torch.zeros_like(p) for p in self.params}
        loss_sum = torch.zeros((), device=self.params[0].device)
        for mb in microbatches:
            with self.persample.capture(batch_size(mb)):
                losses = loss_fn(self.model, mb)
                losses.sum().backward()
            grads = self.persample.grads
            if self._check_coverage:
                self._verify_coverage(grads)
            factors = clip_factors(per_sample_norms(grads), self.noise.max_grad_norm)
            for p, g in weighted_sum(grads, factors).items():
                summed[p] += g
            self.persample.clear()
            loss_sum = loss_sum + losses.detach().sum()
        std = self.noise.sigma * self.noise.max_grad_norm
        for p in self.params:
            if std > 0:  # sigma = 0 only for privacy=none: clipping without noise
                summed[p] += std * torch.randn(p.shape, generator=self.noise.generator, device=p.device,
                                               dtype=p.dtype)
            p.grad = summed[p] / self.noise.expected_batch_size
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum

    def _verify_coverage(self, grads) -> None:
        """Once, before training goes on: the per-sample gradients must sum to autograd's batch gradient. A
        parameter also used outside the module that owns it would otherwise be under-clipped."""
        self._check_coverage = False
        if self.params[0].device.type == "meta":
            return
        names = {p: n for n, p in self.model.named_parameters()}
        pairs = [(p, p.grad, grads.get(p)) for p in self.params]
        for p in self.params:
            p.grad = None
        # float32 sums differ in rounding only; gradients that vanish analytically (attention key biases) are
        # compared against the scale of the whole gradient, not their own
        scale = max(float(b.abs().max()) for _, b, _ in pairs if b is not None)
        for p, batch_grad, per_sample in pairs:
            if batch_grad is None or per_sample is None:
                continue
            if not torch.allclose(per_sample.sum(0), batch_grad, rtol=1e-3, atol=1e-4 * scale):
                raise RuntimeError(f"per-sample gradients of {names[p]} do not sum to its batch gradient: it is "
                                   "used outside the module that owns it; add a rule for that module")
