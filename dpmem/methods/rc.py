"""DP-SGD-RC (Efficient DP-SGD for LLMs with Randomized Clipping) §4, Algorithms 1–2: DP-SGD with randomized
clipping. Two backward passes, as ghost clipping, but the per-sample squared norm of every linear-like matrix
(Linear, Conv1D, Conv2d, Embedding, tied sums) is a Hutchinson or Hutch++ estimate with k fresh probes on its
larger side; other parameters are normed exactly:

    R²ᵢ = Σ_l n̂ᵢ,ₗ (estimated)  + Σ_e ‖gᵢ,ₑ‖² (exact)
    G̃ = ( Σᵢ min(1, C/Rᵢ)·gᵢ + N(0, σ²C² I) ) / (q·n)                      second pass, then SGD/Adam(W)

(as printed, the paper's Algorithm 1 mixes squared and unsquared norms and omits 1/(q·n)). The clipped
contribution's norm is C·‖gᵢ‖/Rᵢ, which may exceed C: σ comes from the rc accountant, whose envelope needs the
dimension `rc_dimension` gives.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from torch import nn

from dpmem import distributed
from dpmem.config import ConfigError, DPSGDRCConfig, enum_value
from dpmem.methods.base import check_positive
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.dp_adam import DPAdam
from dpmem.persample import factored_weights


class DPSGDRC(DPAdam):
    config = DPSGDRCConfig
    # its own accountant (the module docstring says why); k probes per estimate, in one pass (book-keeping) or two
    spec = dataclasses.replace(DPAdam.spec, accountant="rc", plan=lambda m: ClippingPlan.of(
        enum_value(m.estimator), m.k, bookkeeping=m.bookkeeping))

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        check_positive(cfg.method, "k")  # probes per estimate


def estimated_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The trainable weights whose per-sample squared norms dp-sgd-rc estimates, a tied weight once."""
    return list({id(p): p for p in factored_weights(model).values()}.values())


def check_probes(model: nn.Module, k: int) -> None:
    """method.k within what probes can be worth: an estimate of a p×d matrix's norm with k probes of its larger side n
    costs B·k·(T + n), and at k ≥ n more than the exact norm (B·p·d, fgc), which plain clipping (method=dp-sgd,
    accounted without the estimate's randomness) gives. k beyond the larger side of every estimated matrix is
    refused; up to the default k, which a small model's layers may not reach, it is a warning. Raises ConfigError."""
    sides = [max(p.shape[0], math.prod(p.shape[1:])) for p in estimated_matrices(model)]
    if not sides or k <= max(sides):
        return
    widest = max(sides)
    why = (f"{k} probes exceed the larger side of every estimated layer (at most {widest}): there an estimate costs "
           f"more than the exact norm, which method=dp-sgd (method.clipping=fgc) computes")
    if k > DPSGDRCConfig.k:
        raise ConfigError("method.k", f"{why}; allowed: 1..{widest}")
    if distributed.is_main():
        print(f"dpmem: warning: method.k: {why}", file=sys.stderr)


def max_layer_dimension(model: nn.Module) -> int:
    """The DP-SGD-RC paper's d: the max over estimated p×d matrices of min(p, d), the number of eigen-directions of one
    sample's gradient of that matrix (a Conv2d weight is out × in·kh·kw)."""
    mats = estimated_matrices(model)
    if not mats:
        raise ValueError("the model has no linear-like weight whose norm dp-sgd-rc would estimate")
    return max(min(p.shape[0], math.prod(p.shape[1:])) for p in mats)


def rc_dimension(model: nn.Module, choice="model"):
    """d for the rc accountant: "model" (the sound default), "max_layer" (DP-SGD-RC's choice) or a given integer.

    Per Prop. 5.2 a single estimated p×d matrix gives 1/Z² = Σⱼ λⱼ χ²ⱼ(k)/k over its min(p, d) eigen-directions.
    With more than one estimated matrix, or any exactly normed parameter, 1/Z² is a convex combination over all of
    them (and, by Prop. B.24, over exact ones equal to 1), so the sound envelope is the d → ∞ one (that of
    Hutch++): "model" gives inf then, and min(p, d) for a model that trains one matrix alone. The paper's d = max
    over layers of min(p, d) leaves out the other layers' directions and the exact ones, and so understates ε for
    a whole model (by little: the d → ∞ envelope moves σ by 0.05% at the paper's Table 4 setting)."""
    if choice == "max_layer":
        return max_layer_dimension(model)
    if choice != "model":
        return choice  # an integer, checked by the config
    trainable = [p for p in model.parameters() if p.requires_grad]
    mats = estimated_matrices(model)
    if len(trainable) == 1 and len(mats) == 1 and mats[0] is trainable[0]:
        return max_layer_dimension(model)
    return math.inf
