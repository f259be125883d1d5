"""nn.Linear: y = x Wᵀ + b, so sample i's weight gradient is Σ_t G[i,t] ⊗ A[i,t] (kept as the factors G, A) and
its bias gradient Σ_t G[i,t], summed over any middle (token) dims."""

import torch.nn.functional as F
from torch import nn

from dpmem.persample.factored import Factored, batch_rows
from dpmem.persample.registry import always, register


@register(nn.Linear, call=F.linear, factored=always, projectable=True)
def linear(module: nn.Linear, inputs, grad_output) -> dict:
    a = batch_rows(inputs, grad_output.shape[0], module.weight.dtype)
    g = batch_rows(grad_output, grad_output.shape[0], module.weight.dtype)
    grads = {"weight": Factored.outer(g, a)}
    if module.bias is not None:
        grads["bias"] = g.sum(1)
    return grads
