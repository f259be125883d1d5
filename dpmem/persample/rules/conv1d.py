"""Hugging Face Conv1D (GPT-2 style): y = x W + b with W of shape (in, out), so sample i's weight gradient is
Σ_t A[i,t] ⊗ G[i,t] (kept as the factors A, G) and its bias gradient Σ_t G[i,t]."""

from transformers.pytorch_utils import Conv1D

from dpmem.persample.factored import Factored, batch_rows
from dpmem.persample.registry import always, register


@register(Conv1D, factored=always, projectable=True)
def conv1d(module: Conv1D, inputs, grad_output) -> dict:
    a = batch_rows(inputs, grad_output.shape[0], module.weight.dtype)
    g = batch_rows(grad_output, grad_output.shape[0], module.weight.dtype)
    return {"weight": Factored.outer(a, g), "bias": g.sum(1)}
