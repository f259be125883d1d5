"""DP-GRAPE (REFERENCE §2.3, Algorithms 1–2; arXiv version): gradient random projection.

    for each projected matrix W (m×n): P ~ N(0, 1/r) ∈ R^{m×r}, regenerated from (run seed, layer, t // F)
    Rᵢ = Pᵀ Gᵢ, computed inside the backward pass from the layer's input and output gradient (never B×m×n)
    R̃ = ( Σᵢ clip([Rᵢ, gᵢ of unprojected parameters], C) + N(0, σ²C² I) ) / (q·n)      flat clipping
    M ← β₁M + (1−β₁)R̃ ;  V ← β₂V + (1−β₂)R̃² ;  α = η·√(1−β₂ᵗ)/(1−β₁ᵗ)
    W ← W − α · P (M / (√V + ε̂))                                             moments are r×n

The papers assume m ≤ n and project the m side; for m > n they leave the side open. dpmem always projects the
smaller side: rows (R = PᵀG, r×n) when m ≤ n, columns (R = G P, m×r) otherwise, with P ∈ R^{min(m,n)×r}.
Unprojected parameters (embeddings, LayerNorm, biases, the output head, ...) get full per-sample gradients in the
same flat norm, full-dimensional noise and plain Adam moments.
"""

from __future__ import annotations

import fnmatch
import math

import torch
from torch import nn

from dpmem.config import ConfigError
from dpmem.methods.base import Method, Noise
from dpmem.methods.privatize import Privatizer
from dpmem.persample import Projection

# Output heads stay unprojected by default, as in the paper (RoBERTa's LM head, classifiers).
HEAD_PATTERNS = ("*classifier*", "*lm_head*", "score", "*.score", "*qa_outputs*")


class Grape(Method):
    private = True

    def __init__(self, model, cfg, lr, noise: Noise, seed: int = 0):
        super().__init__(model, cfg, lr)
        self.privatize = Privatizer(model, noise, cfg.check_coverage)
        self.params = self.privatize.params
        self.lr, self.rank, self.refresh = lr, cfg.rank, cfg.refresh
        self.betas, self.eps, self.weight_decay = tuple(cfg.betas), cfg.eps, cfg.weight_decay
        self.seed, self.t = seed, 0
        self.optimizer = None
        self.sides = self._choose_projected(cfg.projected)  # parameter -> projected side (0 rows, 1 columns)
        self.layer_index = {p: i for i, p in enumerate(self.sides)}
        self.moments = {p: (torch.zeros(self._shape(p), device=p.device, dtype=p.dtype),
                            torch.zeros(self._shape(p), device=p.device, dtype=p.dtype)) for p in self.params}

    def _choose_projected(self, patterns) -> dict[nn.Parameter, int]:
        candidates = self.privatize.persample.projectable()
        if patterns is None:
            chosen = {n: p for n, p in candidates.items()
                      if not any(fnmatch.fnmatch(n, pat) for pat in HEAD_PATTERNS)}
        else:
            chosen = {n: p for n, p in candidates.items() if any(fnmatch.fnmatch(n, pat) for pat in patterns)}
            if not chosen:
                raise ConfigError("method.projected", f"{list(patterns)} matches no projectable layer; "
                                  f"allowed: {', '.join(candidates) or 'none (no Linear/Conv1D layers)'}")
        owners = {}
        for n, p in candidates.items():
            owners.setdefault(p, []).append(n)
        tied = [n for n, p in chosen.items() if len(owners[p]) > 1 or p.dim() != 2]
        if tied:
            raise ConfigError("method.projected", f"{tied[0]} is shared by several layers; leave it unprojected")
        return {p: 0 if p.shape[0] <= p.shape[1] else 1 for p in chosen.values()}

    def _shape(self, p: nn.Parameter) -> torch.Size:
        if p not in self.sides:
            return p.shape
        rows, cols = p.shape
        return torch.Size((self.rank, cols) if self.sides[p] == 0 else (rows, self.rank))

    def projection(self, p: nn.Parameter, t: int) -> Projection:
        """P for parameter p at (1-based) step t: N(0, 1/r), regenerated from (run seed, layer, t // F)."""
        side = self.sides[p]
        dim = p.shape[side]
        period = t // self.refresh
        seed = ((self.seed * 1_000_003 + self.layer_index[p]) * 1_000_033 + period) % 2**63
        gen = None
        if p.device.type != "meta":
            gen = torch.Generator(device=p.device).manual_seed(seed)
        P = torch.randn(dim, self.rank, generator=gen, device=p.device, dtype=torch.float32) / math.sqrt(self.rank)
        return Projection(P.to(p.dtype), side)

    @staticmethod
    def project(g: torch.Tensor, proj: Projection) -> torch.Tensor:
        return proj.P.T @ g if proj.side == 0 else g @ proj.P

    @staticmethod
    def lift(u: torch.Tensor, proj: Projection) -> torch.Tensor:
        return proj.P @ u if proj.side == 0 else u @ proj.P.T

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def state_tensors(self) -> list[torch.Tensor]:
        return [m for pair in self.moments.values() for m in pair]

    def step(self, microbatches, loss_fn):
        self.t += 1
        t = self.t
        self.privatize.persample.projections = {p: (lambda p=p: self.projection(p, t)) for p in self.sides}
        grads, loss_sum = self.privatize(
            microbatches, loss_fn, {p: self._shape(p) for p in self.params},
            coverage_transform=lambda p, g: self.project(g, self.projection(p, t)) if p in self.sides else g)
        beta1, beta2 = self.betas
        alpha = self.lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        with torch.no_grad():
            for p in self.params:
                m, v = self.moments[p]
                m.mul_(beta1).add_(grads[p], alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grads[p], grads[p], value=1 - beta2)
                update = m / (v.sqrt() + self.eps)
                if p in self.sides:
                    update = self.lift(update, self.projection(p, t))  # one layer's P at a time
                if self.weight_decay:
                    p.mul_(1 - self.lr * self.weight_decay)
                p.sub_(alpha * update)
        return loss_sum
