"""Adam with moments in a projected space (DP-GRAPE (arXiv 2506.15588) §3.2, Algorithm 2; shared with GaLore):

    M ← β₁M + (1−β₁)R ;  V ← β₂V + (1−β₂)R² ;  α = η·√(1−β₂ᵗ)/(1−β₁ᵗ) ;  W ← W − α · lift(M / (√V + ε̂))

Parameters without a projection keep full-size moments and lift is the identity. Under FSDP (`dpmem.sharding`) each
rank keeps the moments of its rows of an unprojected parameter, and lifts the update onto its rows only. The caller
says which projection lifts each parameter at step t (regenerated for DP-GRAPE, stored for GaLore); moments carry
over when the projection changes, as the algorithm is written.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Callable

import torch
from torch import nn

from dpmem import sharding
from dpmem.config import ConfigError
from dpmem.methods.base import Method, check_positive
from dpmem.methods.privatize import Privatizer
from dpmem.persample import Projection, projectable_weights

# Output heads stay unprojected by default, as in the DP-GRAPE paper (RoBERTa's LM head, classifiers).
HEAD_PATTERNS = ("*classifier*", "*lm_head*", "score", "*.score", "*qa_outputs*")


def choose_projected(model: nn.Module, patterns, rank: int, embeddings: bool = False,
                     key: str = "method.projected") -> dict[nn.Parameter, int]:
    """Parameter -> projected side (0 = rows when rows <= cols, else 1 = columns: always the smaller one) for the
    layers named by `patterns` (fnmatch on module names; None = every projectable layer but the output head).
    A matrix whose smaller side is at most `rank` (a LoRA adapter, r×in or out×r) is never projected: its
    projection would be no smaller than the matrix. `embeddings` adds every embedding matrix and any layer tied to
    one (an LM head), projected along the hidden dimension (side 1): beyond the paper, which leaves them
    unprojected. `key`: the config key the patterns came from, which a refusal names."""
    all_weights = projectable_weights(model)
    modules = dict(model.named_modules())
    embedding_weights = {n: p for n, p in all_weights.items() if isinstance(modules[n], nn.Embedding)}
    candidates = {n: p for n, p in all_weights.items() if n not in embedding_weights and min(p.shape) > rank}
    # a weight also used by another module (a tied LM head) has per-sample gradients that are not all projectable
    shared = {id(p) for name, module in model.named_modules() for p in module.parameters(recurse=False)
              if name not in candidates}
    if patterns is None:
        chosen = {n: p for n, p in candidates.items()
                  if not any(fnmatch.fnmatch(n, pat) for pat in HEAD_PATTERNS) and id(p) not in shared}
    else:
        chosen = {n: p for n, p in candidates.items() if any(fnmatch.fnmatch(n, pat) for pat in patterns)}
        if not chosen:
            raise ConfigError(key, f"{list(patterns)} matches no projectable layer; allowed: "
                              f"{', '.join(candidates) or f'none (no Linear/Conv1D layer with both sides > {rank})'}")
        tied = [n for n, p in chosen.items() if id(p) in shared]
        if tied and not embeddings:
            raise ConfigError(key, f"{tied[0]} shares its weight with another layer; leave it unprojected")
    sides = {p: 0 if p.shape[0] <= p.shape[1] else 1 for p in chosen.values()}
    if embeddings:
        tied_heads = {id(e) for e in embedding_weights.values()}
        for n, p in all_weights.items():
            if n in embedding_weights or id(p) in tied_heads:
                sides[p] = 1
    if not sides:  # the method would run as its unprojected twin under its own name
        widest = max((min(p.shape) for n, p in all_weights.items() if n not in embedding_weights
                      and not any(fnmatch.fnmatch(n, pat) for pat in HEAD_PATTERNS)), default=0)
        raise ConfigError("method.rank", f"{rank} is at least the smaller side of every projectable layer (at most "
                          f"{widest}): nothing would be projected; allowed: 1..{widest - 1}" if widest > 1 else
                          "the model has no layer to project (Linear, Conv1D)")
    return sides


def projected_shape(p: nn.Parameter, side: int | None, rank: int) -> torch.Size:
    if side is None:
        return p.shape
    rows, cols = p.shape
    return torch.Size((rank, cols) if side == 0 else (rows, rank))


class ProjectedAdam:
    def __init__(self, params: list[nn.Parameter], shapes: dict[nn.Parameter, torch.Size], betas, eps: float,
                 weight_decay: float = 0.0):
        self.params, self.betas, self.eps, self.weight_decay = params, tuple(betas), eps, weight_decay
        self.row_shards = {p for p in params if sharding.is_sharded(p) and shapes[p] == p.shape}
        local = {p: sharding.local(p).shape if p in self.row_shards else shapes[p] for p in params}
        self.moments = {p: (torch.zeros(local[p], device=p.device, dtype=p.dtype),
                            torch.zeros(local[p], device=p.device, dtype=p.dtype)) for p in params}

    def state_tensors(self) -> list[torch.Tensor]:
        return [m for pair in self.moments.values() for m in pair]

    def state_dict(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every moment whole (under FSDP, a row shard's gathered: a collective)."""
        return [tuple(sharding.full_rows(m, p) if p in self.row_shards else m for m in self.moments[p])
                for p in self.params]

    def load_state_dict(self, state: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for p, whole in zip(self.params, state):
            rows = sharding.rows(p) if p in self.row_shards else slice(None)
            for mine, saved in zip(self.moments[p], whole):
                mine.copy_(saved[rows])

    @torch.no_grad()
    def step(self, grads: dict[nn.Parameter, torch.Tensor], lr: float, t: int,
             projection: Callable[[nn.Parameter], Projection | None]) -> None:
        """The moments and the unprojected parameters move in for-each ops over all of them (a few kernels per
        step); each projected update is lifted and applied one layer at a time (one full-size update at a time)."""
        beta1, beta2 = self.betas
        alpha = lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        ms, vs = (list(moments) for moments in zip(*(self.moments[p] for p in self.params)))
        gs = [grads[p][sharding.rows(p)] if p in self.row_shards else grads[p] for p in self.params]
        torch._foreach_mul_(ms, beta1)
        torch._foreach_add_(ms, gs, alpha=1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
        denominators = torch._foreach_sqrt(vs)
        torch._foreach_add_(denominators, self.eps)
        targets = [sharding.local(p) for p in self.params]
        if self.weight_decay:
            torch._foreach_mul_(targets, 1 - lr * self.weight_decay)
        plain = []
        for p, target, m, d in zip(self.params, targets, ms, denominators):
            proj = projection(p)
            if proj is None:
                plain.append((target, m, d))
            else:  # rows: all of them, or this rank's shard's
                target.sub_(proj.lift(m / d, sharding.rows(p)), alpha=alpha)
        if plain:
            torch._foreach_addcdiv_(*(list(column) for column in zip(*plain)), value=-alpha)


class ProjectedMethod(Method):
    """A method that steps `ProjectedAdam` (DP-GRAPE, GaLore), on its `Privatizer`'s gradient when private."""

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        check_positive(cfg.method, "rank", "refresh")  # the projections' rank r, refreshed every F steps

    def __init__(self, model, cfg, lr, mechanism=None, seed: int = 0, embeddings: bool = False):
        super().__init__(model, cfg, lr, mechanism, seed)
        if self.spec.private:
            self.privatizer = Privatizer(model, mechanism, self.clipping_plan(cfg), cfg.check_coverage)
        self.params = self.privatizer.params if self.privatizer else [p for p in model.parameters() if p.requires_grad]
        self.rank, self.refresh, self.t = cfg.rank, cfg.refresh, 0
        # parameter -> projected side (0 rows, 1 columns)
        self.sides = choose_projected(model, cfg.projected, cfg.rank, embeddings)
        self.shapes = {p: projected_shape(p, self.sides.get(p), self.rank) for p in self.params}
        self.adam = ProjectedAdam(self.params, self.shapes, cfg.betas, cfg.eps, cfg.weight_decay)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.adam.state_tensors()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "t": self.t, "adam": self.adam.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.t = state["t"]
        self.adam.load_state_dict(state["adam"])
