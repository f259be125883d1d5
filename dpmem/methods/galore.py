"""GaLore and naive DP-GaLore (DP-GRAPE (arXiv 2506.15588) §3.1 and App. B, Algorithms 4 and 5).

    every F steps (and at the first): U, S, Vᵀ ← SVD(G̃);  P ← top-r singular vectors of the smaller side
    R̃ = Pᵀ G̃ (or G̃ P);  projected Adam on R̃, the update lifted back with the stored P

GaLore takes G̃ from an ordinary backward pass. Naive DP-GaLore privatises first, exactly as DP-Adam (full
per-sample gradients, flat clipping, full-dimensional noise), and only then projects: its sole gradient source
is the Privatizer, so the SVD sees nothing but the privatised gradient (post-processing, no privacy cost).
"""

from __future__ import annotations

import torch

from dpmem import distributed
from dpmem.config import GaLoreDPNaiveConfig, ProjectedConfig
from dpmem.data.bundle import real_size, weights
from dpmem.methods.base import MethodSpec
from dpmem.methods.clipping_plan import configured
from dpmem.methods.projected_adam import ProjectedMethod
from dpmem.persample import Projection
from dpmem.privacy.mechanism import GaussianMechanism


def svd_projection(g: torch.Tensor, side: int, rank: int) -> Projection:
    """Top-`rank` left singular vectors (side 0, m×r) or right singular vectors (side 1, n×r) of g."""
    u, _, vh = torch.linalg.svd(g.float(), full_matrices=False)
    P = u[:, :rank] if side == 0 else vh[:rank].T
    return Projection(P.to(g.dtype).contiguous(), side)


class GaLore(ProjectedMethod):
    config = ProjectedConfig

    def __init__(self, model, cfg, lr, mechanism: GaussianMechanism | None = None, seed: int = 0):
        super().__init__(model, cfg, lr, mechanism, seed)
        self.projections: dict[torch.nn.Parameter, Projection] = {}  # stored: r·Σm, as in the paper's Table 2

    def gradient(self, microbatches, loss_fn) -> tuple[dict | None, torch.Tensor]:
        """The batch-mean gradient of an ordinary backward pass (micro-batches accumulate; ranks sum theirs), None
        when the logical batch is empty."""
        total = distributed.total(sum(real_size(mb) for mb in microbatches))
        loss_sum = torch.zeros((), device=self.params[0].device)
        if not total:
            return None, loss_sum
        for mb in microbatches:
            losses = loss_fn(self.model, mb) * weights(mb)
            (losses.sum() / total).backward()
            loss_sum = loss_sum + losses.detach().sum()
        distributed.reduce_gradients(self.params)
        grads = {p: p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params}
        for p in self.params:
            p.grad = None
        return grads, loss_sum

    def state_tensors(self) -> list[torch.Tensor]:
        return super().state_tensors() + [proj.P for proj in self.projections.values()]

    def state_dict(self) -> dict:
        index = {p: i for i, p in enumerate(self.params)}
        return {**super().state_dict(), "projections": {index[p]: (q.P, q.side) for p, q in self.projections.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.projections = {self.params[i]: Projection(P.to(self.params[i].device), side)
                            for i, (P, side) in state["projections"].items()}

    def step(self, microbatches, loss_fn):
        grads, loss_sum = self.gradient(microbatches, loss_fn)
        if grads is None:  # nothing sampled: no gradient, no step
            return loss_sum
        self.t = t = self.t + 1
        for p, side in self.sides.items():
            if p not in self.projections or t % self.refresh == 0:
                self.projections[p] = svd_projection(grads[p], side, self.rank)
            grads[p] = self.projections[p].project(grads[p])
        self.adam.step(grads, self.lr, t, self.projections.get)
        return loss_sum


class GaLoreDPNaive(GaLore):
    config = GaLoreDPNaiveConfig
    spec = MethodSpec(private=True, privatised_gradient=True, compiled_step=True, plan=configured)

    def compile(self, compiler) -> None:
        """The private step's micro-batches compiled (`Privatizer.compile`); the SVD refresh and projected Adam stay
        eager."""
        self.privatizer.compile(compiler)

    def gradient(self, microbatches, loss_fn):
        return self.privatizer.gradient(microbatches, loss_fn, {p: p.shape for p in self.params})
