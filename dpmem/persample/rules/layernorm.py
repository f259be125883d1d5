"""nn.LayerNorm: y = x̂ ⊙ w + b, so the per-sample gradients are Σ G ⊙ x̂ and Σ G over the non-normalised dims."""

import torch.nn.functional as F
from torch import nn

from dpmem.persample.registry import register


@register(nn.LayerNorm, call=F.layer_norm, weight_at=2)
def layernorm(module: nn.LayerNorm, inputs, grad_output) -> dict:
    batch, shape = grad_output.shape[0], tuple(module.normalized_shape)
    dtype = (module.weight if module.weight is not None else module.bias).dtype
    x_hat = F.layer_norm(inputs.to(dtype), shape, eps=module.eps)
    g = grad_output.to(dtype)
    grads = {}
    if module.weight is not None:
        grads["weight"] = (g * x_hat).reshape(batch, -1, *shape).sum(1)
    if module.bias is not None:
        grads["bias"] = g.reshape(batch, -1, *shape).sum(1)
    return grads
