"""DP-SGD-RC (REFERENCE §2.5, Algorithms 1–2): DP-SGD with randomized clipping. Two backward passes, as ghost
clipping, but the per-sample squared norm of every linear-like matrix (Linear, Conv1D, Conv2d, Embedding, tied
sums) is a Hutchinson or Hutch++ estimate with k fresh probes on its larger side; other parameters are normed
exactly:

    R²ᵢ = Σ_l n̂ᵢ,ₗ (estimated)  + Σ_e ‖gᵢ,ₑ‖² (exact)
    G̃ = ( Σᵢ min(1, C/Rᵢ)·gᵢ + N(0, σ²C² I) ) / (q·n)                      second pass, then SGD/Adam(W)

(the paper's Algorithm 1 mixes squared and unsquared norms and omits 1/(q·n): REFERENCE §8). The clipped
contribution's norm is C·‖gᵢ‖/Rᵢ, which may exceed C: σ comes from the rc accountant, whose envelope needs the
dimension `rc_dimension` gives.
"""

from __future__ import annotations

import math

from torch import nn

from dpmem.config import enum_value
from dpmem.methods.dp_adam import DPAdam
from dpmem.persample import rule_for


class DPSGDRC(DPAdam):
    def clipping(self, cfg) -> str:
        return enum_value(cfg.estimator)


def rc_dimension(model: nn.Module) -> float:
    """d for the rc accountant. Per Prop. 5.2 a single estimated p×d matrix gives 1/Z² = Σⱼ λⱼ χ²ⱼ(k)/k over its
    min(p, d) eigen-directions. With more than one estimated matrix, or any exactly normed parameter, 1/Z² is a
    convex combination over all of them (and, by Prop. B.24, over exact ones equal to 1), so the sound envelope
    is the d → ∞ one (that of Hutch++): then this returns inf. The paper's d = max over layers of min(p, d)
    understates ε for a whole model."""
    uses = [(module, name, p) for module in model.modules()
            for name, p in module.named_parameters(recurse=False) if p.requires_grad]
    if len(uses) == 1:
        module, name, p = uses[0]
        rule = rule_for(module)
        if name == "weight" and rule is not None and rule.factors is not None and getattr(module, "groups", 1) == 1:
            return float(min(p.shape[0], math.prod(p.shape[1:])))
    return math.inf
