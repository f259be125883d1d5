"""Non-private baseline: Adam/AdamW (or SGD) on the mean loss of the sampled batch, with gradient accumulation."""

from __future__ import annotations

import torch

from dpmem import distributed, sharding
from dpmem.config import OptimizerConfig
from dpmem.data.bundle import real_size, weights
from dpmem.methods.base import Method, make_optimizer


class Adam(Method):
    config = OptimizerConfig

    def __init__(self, model, cfg, lr, noise=None, seed=0, observers=()):
        super().__init__(model, cfg, lr)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, cfg, lr)

    shardable = True  # FSDP reduce-scatters autograd's batch gradient

    def step(self, microbatches, loss_fn):
        # the logical batch over all ranks: its real samples (padding ones weigh 0)
        total = distributed.total(sum(real_size(mb) for mb in microbatches))
        loss_sum = torch.zeros(())
        for mb in microbatches:
            losses = loss_fn(self.model, mb) * weights(mb)
            (losses.sum() / max(total, 1)).backward()
            loss_sum = loss_sum.to(losses.device) + losses.detach().sum()
        if total:  # FSDP has reduced its shards' gradients already
            distributed.reduce_gradients([p for p in self.params if not sharding.is_sharded(p)])
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum
