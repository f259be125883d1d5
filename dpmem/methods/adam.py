"""Non-private baseline: Adam/AdamW (or SGD) on the mean loss of the sampled batch, with gradient accumulation."""

from __future__ import annotations

import torch

from dpmem import distributed, sharding
from dpmem.config import OptimizerConfig
from dpmem.data.bundle import real_size, weights
from dpmem.methods.base import Method, MethodSpec, fuse, make_optimizer


class Adam(Method):
    config = OptimizerConfig
    spec = MethodSpec(shardable=True, compiled_step=True)  # FSDP reduce-scatters autograd's batch gradient

    def __init__(self, model, cfg, lr, mechanism=None, seed=0):
        super().__init__(model, cfg, lr)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, cfg, lr)
        self._compiled = None  # the micro-batch step, compiled by `compile`

    def compile(self, compiler) -> None:
        """Each micro-batch's forward and backward compiled (the backward as autograd.grad, its gradients added into
        buffers given); torch's optimiser steps eagerly (its step breaks the graph on purpose)."""
        self._compiled = compiler(self.microbatch, "microbatch")
        self._sums = [torch.zeros_like(p) for p in self.params]
        fuse(self.optimizer)

    def microbatch(self, mb, loss_fn, total: torch.Tensor, sums: list[torch.Tensor]) -> torch.Tensor:
        """The micro-batch's gradient of the batch-mean loss added into `sums`; returns its loss sum."""
        losses = loss_fn(self.model, mb) * weights(mb)
        grads = torch.autograd.grad(losses.sum() / total, self.params, allow_unused=True)
        with torch.no_grad():
            torch._foreach_add_(sums, [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)])
        return losses.detach().sum()

    def step(self, microbatches, loss_fn):
        # the logical batch over all ranks: its real samples (padding ones weigh 0)
        total = distributed.total(sum(real_size(mb) for mb in microbatches))
        loss_sum = torch.zeros(())
        if self._compiled is not None:
            loss_sum = self._compiled_gradients(microbatches, loss_fn, total)
        else:
            for mb in microbatches:
                losses = loss_fn(self.model, mb) * weights(mb)
                (losses.sum() / max(total, 1)).backward()
                loss_sum = loss_sum.to(losses.device) + losses.detach().sum()
        if total:  # FSDP has reduced its shards' gradients already
            distributed.reduce_gradients([p for p in self.params if not sharding.is_sharded(p)])
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum

    def _compiled_gradients(self, microbatches, loss_fn, total: int) -> torch.Tensor:
        torch._foreach_zero_(self._sums)
        divisor = torch.tensor(float(max(total, 1)), device=self._sums[0].device)
        loss_sum = torch.zeros((), device=divisor.device)
        for mb in microbatches:
            loss_sum = loss_sum + self._compiled(mb, loss_fn, divisor, self._sums)
        for p, s in zip(self.params, self._sums):
            p.grad = s
        return loss_sum
