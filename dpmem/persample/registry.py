"""The registry of per-sample gradient rules, one per layer type (the idea of Opacus' register_grad_sampler).

A rule takes the module, the activations its `capture` kept from the forward pass and the gradient of the
module's output (batch first), and returns {parameter name: per-sample gradient}: `Factored` for linear-like
weights (a layer's input and output gradient, never the B×rows×cols product), dense (B, *param.shape) for the
rest. What is then made of them (dense tensors, projections, norms) is the caller's reducer (`reducers.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

Capture = Callable[[nn.Module, tuple, dict, Any], Any]  # (module, args, kwargs, output)
Gradients = Callable[[nn.Module, Any, torch.Tensor], dict[str, Any]]  # -> {name: Factored | dense}


def capture_first_input(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    """The layer's input as it is (a capture detaches what it keeps, where that matters)."""
    return args[0] if args else next(iter(kwargs.values()))


def always(module: nn.Module) -> bool:
    return True


def never(module: nn.Module) -> bool:
    return False


@dataclass(frozen=True)
class Rule:
    gradients: Gradients
    capture: Capture = capture_first_input
    # The function the rule models, called with the layer's input first and its weight at `weight_at` (F.linear's
    # 1): a subclass whose forward is its own is tapped where that forward calls it (`inner_call`)
    call: Callable | None = None
    weight_at: int = 1
    base: type = nn.Module  # the type registered (set by `register`)
    # Optional: raise a ValueError naming the parameter when a module of this type is configured unsupportedly.
    check: Callable[[str, nn.Module], None] | None = None
    # For which modules the weight's per-sample gradient comes out `Factored` (norm estimators apply to those).
    factored: Callable[[nn.Module], bool] = never
    # Whether DP-GRAPE may project the weight (its factored gradient, on one side).
    projectable: bool = False
    # Whether the layer's input is a float tensor through which a gradient can reach the hook; an embedding's ids
    # cannot carry one, so its weight keeps requires_grad under `capture(batch_gradients=False)`.
    float_input: bool = True


RULES: dict[type, Rule] = {}


def register(*types: type, **options):
    def wrap(gradients: Gradients) -> Gradients:
        for t in types:
            RULES[t] = Rule(gradients, base=t, **options)
        return gradients
    return wrap


def _weights(model: nn.Module, wanted: Callable[[Rule, nn.Module], bool]) -> dict[str, nn.Parameter]:
    from dpmem.persample.fallback import replay_of
    out, replayed = {}, [n for n, m in model.named_modules() if replay_of(m) is not None]
    for name, module in model.named_modules():
        if any(name.startswith(f"{r}.") for r in replayed):  # its forward never runs: the replayed layer's does
            continue
        rule = rule_for(module)
        weight = getattr(module, "weight", None)
        if rule is not None and wanted(rule, module) and isinstance(weight, nn.Parameter) and weight.requires_grad:
            out[name] = weight
    return out


def projectable_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """Module name -> trainable weight of every layer whose rule can project its per-sample gradient."""
    return _weights(model, lambda rule, module: rule.projectable)


def factored_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """Module name -> trainable weight of every layer whose per-sample gradient comes out `Factored` (a tied
    weight under each module that uses it)."""
    return _weights(model, lambda rule, module: rule.factored(module))


def inner_call(rule: Rule | None, module: nn.Module) -> bool:
    """Whether the module is a subclass of its rule's type with a forward of its own (Gemma's word embedding scales
    the lookup; OPT's positions compute their ids): its rule must read the call of its function on the weight, not
    the module's input and output, which that forward's own code sits between."""
    return rule is not None and rule.call is not None and type(module).forward is not rule.base.forward


def rule_for(module: nn.Module) -> Rule | None:
    """The rule of the module's type or of its nearest registered base class (subclasses share the math)."""
    for t in type(module).__mro__:
        if t in RULES:
            return RULES[t]
    return None
