"""nn.Linear: y = x Wᵀ + b, so the per-sample gradient is Gᵢᵀ Aᵢ summed over any middle (token) dims."""

import torch
from torch import nn

from dpmem.persample.factored import Factored
from dpmem.persample.registry import projected_outer, register


def _flat(module: nn.Linear, activations, grad_output) -> tuple[torch.Tensor, torch.Tensor]:
    batch = grad_output.shape[0]
    a = activations.reshape(batch, -1, module.in_features).to(module.weight.dtype)
    g = grad_output.reshape(batch, -1, module.out_features).to(module.weight.dtype)
    return a, g


def _project(module: nn.Linear, activations, grad_output, projections) -> dict[str, torch.Tensor]:
    a, g = _flat(module, activations, grad_output)
    grads = {"weight": projected_outer(g, a, projections.get("weight"))}
    if module.bias is not None:
        grads["bias"] = g.sum(1)
    return grads


def _factors(module: nn.Linear, activations, grad_output) -> dict[str, torch.Tensor | Factored]:
    a, g = _flat(module, activations, grad_output)
    grads = {"weight": Factored.outer(g, a)}
    if module.bias is not None:
        grads["bias"] = g.sum(1)
    return grads


@register(nn.Linear, project=_project, factors=_factors)
def linear(module: nn.Linear, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, torch.Tensor]:
    return _project(module, activations, grad_output, {})
