"""Hugging Face Conv1D (GPT-2 style): y = x W + b with W of shape (in, out), so the gradient is Aᵢᵀ Gᵢ."""

import torch
from transformers.pytorch_utils import Conv1D

from dpmem.persample.factored import Factored
from dpmem.persample.registry import projected_outer, register


def _flat(module: Conv1D, activations, grad_output) -> tuple[torch.Tensor, torch.Tensor]:
    batch = grad_output.shape[0]
    n_in, n_out = module.weight.shape
    a = activations.reshape(batch, -1, n_in).to(module.weight.dtype)
    g = grad_output.reshape(batch, -1, n_out).to(module.weight.dtype)
    return a, g


def _project(module: Conv1D, activations, grad_output, projections) -> dict[str, torch.Tensor]:
    a, g = _flat(module, activations, grad_output)
    return {"weight": projected_outer(a, g, projections.get("weight")), "bias": g.sum(1)}


def _factors(module: Conv1D, activations, grad_output) -> dict[str, torch.Tensor | Factored]:
    a, g = _flat(module, activations, grad_output)
    return {"weight": Factored.outer(a, g), "bias": g.sum(1)}


@register(Conv1D, project=_project, factors=_factors)
def conv1d(module: Conv1D, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, torch.Tensor]:
    return _project(module, activations, grad_output, {})
