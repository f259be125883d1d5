"""The registry of per-sample gradient rules, one per layer type (the idea of Opacus' register_grad_sampler).

A rule takes the module, the activations its `capture` kept from the forward pass and the gradient of the
module's output (batch first), and returns {parameter name: per-sample gradient of shape (B, *param.shape)}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

Capture = Callable[[nn.Module, tuple, dict, Any, Any], Any]  # (module, args, kwargs, output, scope)
Compute = Callable[[nn.Module, Any, torch.Tensor], dict[str, torch.Tensor]]
# (module, activations, grad_output, {param name: Projection}) -> per-sample gradients, projected where asked
Project = Callable[[nn.Module, Any, torch.Tensor, dict], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Projection:
    """Project a matrix parameter's per-sample gradients (B, rows, cols) on one side with P (dim, r):
    side 0 gives Pᵀ·grad of shape (B, r, cols), side 1 gives grad·P of shape (B, rows, r)."""
    P: torch.Tensor
    side: int

    def project(self, g: torch.Tensor) -> torch.Tensor:
        """A (rows, cols) matrix to its projected form."""
        return self.P.T @ g if self.side == 0 else g @ self.P

    def lift(self, u: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """A projected matrix back to (rows, cols), or only the given rows of it (an FSDP shard's)."""
        return self.P[rows] @ u if self.side == 0 else u[rows] @ self.P.T


def projected_outer(x: torch.Tensor, y: torch.Tensor, projection: Projection | None) -> torch.Tensor:
    """Per-sample xᵢᵀ yᵢ for x (B, T, rows), y (B, T, cols), projected before the product when asked, so that
    (B, rows, cols) never exists: side 0 is (xᵢP)ᵀyᵢ, side 1 is xᵢᵀ(yᵢP)."""
    if projection is None:
        return torch.bmm(x.transpose(1, 2), y)
    P = projection.P.to(x.dtype)
    if projection.side == 0:
        return torch.bmm((x @ P).transpose(1, 2), y)
    return torch.bmm(x.transpose(1, 2), y @ P)


def capture_first_input(module: nn.Module, args: tuple, kwargs: dict, output: Any, scope: Any) -> torch.Tensor:
    return args[0].detach() if args else next(iter(kwargs.values())).detach()


@dataclass(frozen=True)
class Rule:
    compute: Compute
    capture: Capture = capture_first_input
    # Optional: a context entered around the module's forward (for rules that must see inside it).
    scope: Callable[[nn.Module], Any] | None = None
    # Optional: raise a ValueError naming the parameter when a module of this type is configured unsupportedly.
    check: Callable[[str, nn.Module], None] | None = None
    # Optional: per-sample gradients with some matrix parameters projected (DP-GRAPE); None = not projectable.
    project: Project | None = None
    # Optional: per-sample gradients as `Factored` outer products (linear-like layers), for ghost norms and
    # norm estimators; None = only the dense `compute`. `factorable` says for which modules the weight's gradient
    # does come out factored (`factors` falls back to the dense form for the others).
    factors: Compute | None = None
    factorable: Callable[[nn.Module], bool] = lambda module: True


RULES: dict[type, Rule] = {}


def register(*types: type, capture: Capture = capture_first_input, scope=None, check=None, project=None,
             factors=None, factorable=Rule.factorable):
    def wrap(compute: Compute) -> Compute:
        for t in types:
            RULES[t] = Rule(compute, capture, scope, check, project, factors, factorable)
        return compute
    return wrap


def _weights(model: nn.Module, wanted: Callable[[Rule, nn.Module], bool]) -> dict[str, nn.Parameter]:
    out = {}
    for name, module in model.named_modules():
        rule = rule_for(module)
        weight = getattr(module, "weight", None)
        if rule is not None and wanted(rule, module) and isinstance(weight, nn.Parameter) and weight.requires_grad:
            out[name] = weight
    return out


def projectable_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """Module name -> trainable weight of every layer whose rule can project its per-sample gradient."""
    return _weights(model, lambda rule, module: rule.project is not None)


def factored_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """Module name -> trainable weight of every layer whose per-sample gradient comes out `Factored` in the
    two-pass pipeline (a tied weight under each module that uses it)."""
    return _weights(model, lambda rule, module: rule.factors is not None and rule.factorable(module))


def rule_for(module: nn.Module) -> Rule | None:
    """The rule of the module's type or of its nearest registered base class (subclasses share the math)."""
    for t in type(module).__mro__:
        if t in RULES:
            return RULES[t]
    return None
