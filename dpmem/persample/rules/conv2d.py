"""nn.Conv2d: unfold the input into patches (B, in·kh·kw, L); then the per-sample gradient is Gᵢ colsᵢᵀ per group."""

import torch
import torch.nn.functional as F
from torch import nn

from dpmem.persample.factored import Factored
from dpmem.persample.registry import register


def _explicit_padding(module: nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """Apply non-zero padding modes and 'same' padding to x so that unfold needs only symmetric zeros."""
    if module.padding_mode != "zeros":
        return F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode), (0, 0)
    if module.padding == "valid":
        return x, (0, 0)
    if module.padding == "same":  # total dilation*(k-1), the extra one on the right/bottom as PyTorch does
        pads = []
        for k, d in zip(reversed(module.kernel_size), reversed(module.dilation)):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return F.pad(x, pads), (0, 0)
    return x, module.padding


def _unfold(module: nn.Conv2d, activations, grad_output) -> tuple[torch.Tensor, torch.Tensor]:
    """Patches (B, in·kh·kw, L) and output gradients (B, out, L)."""
    x, padding = _explicit_padding(module, activations.to(module.weight.dtype))
    cols = F.unfold(x, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride)
    return cols, grad_output.reshape(grad_output.shape[0], module.out_channels, -1).to(module.weight.dtype)


@register(nn.Conv2d, factored=lambda module: module.groups == 1)
def conv2d(module: nn.Conv2d, inputs, grad_output) -> dict:
    """Ungrouped, the convolution is linear in its patches: gᵢ = Σ_l G[:, l] ⊗ cols[:, l], kept factored. Grouped,
    each group's gradient is its own G colsᵀ, made dense."""
    batch, groups = grad_output.shape[0], module.groups
    cols, g = _unfold(module, inputs, grad_output)
    if groups == 1:
        weight = Factored.outer(g.transpose(1, 2), cols.transpose(1, 2), param_shape=module.weight.shape)
    else:
        cols = cols.reshape(batch, groups, -1, cols.shape[-1])
        weight = torch.einsum("bgol,bgil->bgoi", g.reshape(batch, groups, -1, g.shape[-1]), cols)
        weight = weight.reshape(batch, *module.weight.shape)
    grads = {"weight": weight}
    if module.bias is not None:
        grads["bias"] = g.sum(2)
    return grads
