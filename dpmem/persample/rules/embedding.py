"""nn.Embedding (and subclasses such as OPT's learned positions): the gradient of row v is the sum of G over the
positions whose index is v, kept factored (token ids and rows, `Factored`) so that no (B, vocab, D) tensor is made. The indices are
read from the F.embedding call itself, because subclasses may compute them inside forward (OPT derives positions
from the attention mask)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dpmem.persample.registry import register
from dpmem.persample.factored import Factored


class _RecordIndices(TorchFunctionMode):
    """Active only during one embedding module's forward: records the indices looked up in its weight."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight, self.indices = weight, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            weight = kwargs.get("weight", args[1] if len(args) > 1 else None)
            if weight is self.weight:
                self.indices = (kwargs.get("input", args[0] if args else None)).detach()
        return func(*args, **kwargs)


def _scope(module: nn.Embedding) -> _RecordIndices:
    return _RecordIndices(module.weight)


def _capture(module, args, kwargs, output, scope: _RecordIndices) -> torch.Tensor:
    if scope.indices is None:
        raise RuntimeError(f"{type(module).__name__} did not call F.embedding on its own weight")
    return scope.indices


def _check(name: str, module: nn.Embedding) -> None:
    if module.sparse or module.scale_grad_by_freq or module.max_norm is not None:
        raise ValueError(f"{name}: per-sample gradients need a plain nn.Embedding (sparse, scale_grad_by_freq "
                         "and max_norm mix samples or rewrite the weight); turn those options off or freeze it")


def _project(module: nn.Embedding, indices, grad_output, projections) -> dict[str, Factored]:
    """Rows projected along the hidden dimension (side 1: (B, vocab, r)), still factored."""
    batch, dim = grad_output.shape[0], module.embedding_dim
    ids = indices.reshape(batch, -1)
    g = grad_output.reshape(batch, -1, dim).to(module.weight.dtype)
    if module.padding_idx is not None:  # F.embedding gives the padding row no gradient
        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
    projection = projections.get("weight")
    if projection is not None:
        if projection.side != 1:
            raise ValueError("embeddings are projected along the hidden dimension (side 1) only")
        g = g @ projection.P.to(g.dtype)
    return {"weight": Factored.outer(ids, g, rows=module.num_embeddings)}


def _factors(module: nn.Embedding, indices, grad_output) -> dict[str, Factored]:
    return _project(module, indices, grad_output, {})


@register(nn.Embedding, capture=_capture, scope=_scope, check=_check, project=_project, factors=_factors)
def embedding(module: nn.Embedding, indices: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Factored]:
    """Factored even here: the dense form would be (B, vocab, D)."""
    return _factors(module, indices, grad_output)
