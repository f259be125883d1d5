"""DP-GRAPE (arXiv 2506.15588 §3.2, Algorithms 1–2, as the arXiv version prints them): gradient random projection.

    for each projected matrix W (m×n): P ~ N(0, 1/r) ∈ R^{m×r}, regenerated from (run seed, layer, t // F)
    Rᵢ = Pᵀ Gᵢ, computed inside the backward pass from the layer's input and output gradient (never B×m×n)
    R̃ = ( Σᵢ clip([Rᵢ, gᵢ of unprojected parameters], C) + N(0, σ²C² I) ) / (q·n)      flat clipping
    projected Adam on R̃ (moments r×n), the update lifted back with the regenerated P

The papers assume m ≤ n and project the m side; for m > n they leave the side open. dpmem always projects the
smaller side: rows (R = PᵀG, r×n) when m ≤ n, columns (R = G P, m×r) otherwise, with P ∈ R^{min(m,n)×r}.
Unprojected parameters (embeddings, LayerNorm, biases, the output head, ...) get full per-sample gradients in the
same flat norm, full-dimensional noise and plain Adam moments.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpmem.config import GrapeConfig
from dpmem.methods.base import MethodSpec
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.projected_adam import ProjectedMethod
from dpmem.persample import Projection, reducers
from dpmem.privacy.mechanism import GaussianMechanism


class Grape(ProjectedMethod):
    config = GrapeConfig
    # its clipped sums live in the projected space: no full privatised gradient; the projected per-sample gradients
    # are small: materialised, and all-reduced whole under FSDP
    spec = MethodSpec(private=True, compiled_step=True, plan=lambda m: ClippingPlan.of("materialize", projected=True))

    def __init__(self, model, cfg, lr, mechanism: GaussianMechanism, seed: int = 0):
        super().__init__(model, cfg, lr, mechanism, seed, embeddings=cfg.project_embeddings)
        self.seed, self.layer_index = seed, {p: i for i, p in enumerate(self.sides)}
        self._projection_buffers = None  # compiled: the projections' buffers (`compile`)

    def compile(self, compiler) -> None:
        """The private step's micro-batches compiled (`Privatizer.compile`), given this window's projections: kept
        in one buffer per layer (r·Σm, as GaLore stores them), regenerated on the host when t // F moves on, and
        passed in, so that no generator is made inside a graph. The projected Adam update stays eager."""
        self.privatizer.compile(compiler)
        self._window = None  # the t // F whose projections the buffers hold
        self._projection_buffers = {
            p: Projection(torch.empty(p.shape[side], self.rank, device=p.device, dtype=p.dtype), side)
            for p, side in self.sides.items()}

    def _projections(self, t: int) -> dict:
        """What the step is given: each layer's projection at step t, or what makes it (eager: made when its
        gradient is reduced, one at a time)."""
        if self._projection_buffers is None:
            return {p: (lambda p=p: self.projection(p, t)) for p in self.sides}
        if self._window != t // self.refresh:
            self._window = t // self.refresh
            for p, kept in self._projection_buffers.items():
                kept.P.copy_(self.projection(p, t).P)
        return self._projection_buffers

    def projection(self, p: nn.Parameter, t: int) -> Projection:
        """P for parameter p at (1-based) step t: N(0, 1/r), regenerated from (run seed, layer, t // F): never
        stored, nor checkpointed."""
        side = self.sides[p]
        seed = ((self.seed * 1_000_003 + self.layer_index[p]) * 1_000_033 + t // self.refresh) % 2**63
        gen = None if p.device.type == "meta" else torch.Generator(device=p.device).manual_seed(seed)
        P = torch.normal(0.0, 1 / math.sqrt(self.rank), (p.shape[side], self.rank), generator=gen, device=p.device)
        return Projection(P.to(p.dtype), side)

    def step(self, microbatches, loss_fn):
        self.t = t = self.t + 1
        projections = self._projections(t)
        grads, loss_sum = self.privatizer.gradient(microbatches, loss_fn, self.shapes, projections)
        # eager: one layer's P at a time, regenerated for the update
        self.adam.step(grads, self.lr, t, lambda p: reducers.projection(projections[p]) if p in self.sides else None)
        return loss_sum
