"""DP-Adam / DP-SGD with flat clipping (DP-GRAPE (arXiv 2506.15588) App. A, Algorithm 3): the privatised gradient G̃ of
`Privatizer`, clipped as `method.clipping` says (`dpmem.methods.clipping_plan`), then the configured optimiser (Adam,
AdamW or SGD) steps on it."""

from __future__ import annotations

from dpmem.config import DPAdamConfig
from dpmem.methods.base import (Method, MethodSpec, direct_fused_adam, fuse, fused_adam_step, make_optimizer,
                                own_step_counts)
from dpmem.methods.clipping_plan import configured
from dpmem.methods.privatize import Privatizer
from dpmem.privacy.mechanism import GaussianMechanism


class DPAdam(Method):
    config = DPAdamConfig
    spec = MethodSpec(private=True, privatised_gradient=True, compiled_step=True, plan=configured)
    _fused = False  # train.compile ran `compile`: the optimiser is fused, its steps taken directly

    def __init__(self, model, cfg, lr, mechanism: GaussianMechanism, seed: int = 0):
        super().__init__(model, cfg, lr, mechanism, seed)
        self.privatizer = Privatizer(model, mechanism, self.clipping_plan(cfg), cfg.check_coverage)
        self.params = self.privatizer.params
        self.shapes = {p: p.shape for p in self.params}
        self.optimizer = make_optimizer(self.params, cfg, lr)

    def compile(self, compiler) -> None:
        """The private step's micro-batches compiled (`Privatizer.compile`). torch's optimiser steps eagerly (its
        step breaks the graph on purpose, `torch.optim.optimizer._use_grad`), fused (`fuse`); Adam's and AdamW's
        directly once the first (eager) step has made their state (`fused_adam_step`)."""
        self.privatizer.compile(compiler)
        fuse(self.optimizer)
        self.optimizer.register_step_pre_hook(own_step_counts)
        self._fused = True

    def step(self, microbatches, loss_fn):
        grads, loss_sum = self.privatizer.gradient(microbatches, loss_fn, self.shapes)
        if self._fused and direct_fused_adam(self.optimizer):
            fused_adam_step(self.optimizer, [grads[p] for p in self.params])
            return loss_sum
        for p in self.params:
            p.grad = grads[p]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum
