"""Hugging Face Conv1D (GPT-2 style): y = x W + b with W of shape (in, out), so the gradient is Aᵢᵀ Gᵢ."""

import torch
from transformers.pytorch_utils import Conv1D

from dpmem.persample.registry import register


@register(Conv1D)
def conv1d(module: Conv1D, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, torch.Tensor]:
    batch = grad_output.shape[0]
    n_in, n_out = module.weight.shape
    a = activations.reshape(batch, -1, n_in).to(module.weight.dtype)
    g = grad_output.reshape(batch, -1, n_out).to(module.weight.dtype)
    return {"weight": torch.bmm(a.transpose(1, 2), g), "bias": g.sum(1)}
