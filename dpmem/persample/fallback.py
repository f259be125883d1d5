"""The generic rule for parameters that no layer rule owns (ViT's cls token and position embeddings, ...):
replay the owning module's forward for one sample at a time under torch.func.vmap and take the vector-Jacobian
product with that sample's output gradient. Exact for any module whose forward treats samples independently
and uses no randomness."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


def check_deterministic(name: str, module: nn.Module) -> None:
    if module.training:
        for sub_name, sub in module.named_modules():
            if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
                raise ValueError(f"{name}: its per-sample gradient is computed by replaying {type(module).__name__}, "
                                 f"whose dropout {sub_name or '(self)'} has p={sub.p}; set that dropout to 0")


def capture_call(module, args, kwargs, output, scope):
    detach = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731
    return tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()}


def fallback_grads(module: nn.Module, names: list[str], call: tuple, grad_output: torch.Tensor,
                   fixed: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Per-sample gradients of `module`'s parameters `names`; `fixed`: values for any of its (sub)modules'
    parameters in place of theirs (FSDP's shards gathered whole, as the forward saw them)."""
    args, kwargs = call
    fixed = fixed or {}
    batch = grad_output.shape[0]
    batched = lambda x: isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch  # noqa: E731
    arg_dims = tuple(0 if batched(a) else None for a in args)
    kw_names = [k for k, v in kwargs.items() if batched(v)]
    fixed_kwargs = {k: v for k, v in kwargs.items() if k not in kw_names}
    params = {n: fixed[n] if n in fixed else getattr(module, n).detach() for n in names}
    fixed = {n: t for n, t in fixed.items() if n not in params}

    def sample_loss(p, sample_args, sample_kwargs, g):
        one = lambda x, d: x.unsqueeze(0) if d == 0 else x  # noqa: E731
        a = tuple(one(x, d) for x, d in zip(sample_args, arg_dims))
        kw = {**fixed_kwargs, **{k: v.unsqueeze(0) for k, v in sample_kwargs.items()}}
        out = functional_call(module, {**fixed, **p}, a, kw)
        return (out * g.unsqueeze(0)).sum()

    # randomness="same" is safe: check_deterministic refused any dropout that is active.
    per_sample = vmap(grad(sample_loss), in_dims=(None, arg_dims, 0, 0), randomness="same")
    return per_sample(params, args, {k: kwargs[k] for k in kw_names}, grad_output.to(next(iter(params.values())).dtype))
