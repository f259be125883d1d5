"""nn.Embedding (and subclasses such as OPT's learned positions). The indices are read from the F.embedding call
itself, because subclasses may compute them inside forward (OPT derives positions from the attention mask)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dpmem.persample.factored import Factored, batch_rows
from dpmem.persample.registry import always, register


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


def _scope(module: nn.Embedding) -> _RecordIndices | None:
    """None for a plain nn.Embedding, whose ids are its first argument (no mode to enter: host time, and a
    compiled step's graph)."""
    return None if type(module).forward is nn.Embedding.forward else _RecordIndices(module.weight)


def _capture(module, args, kwargs, output, scope: _RecordIndices | None) -> torch.Tensor:
    if scope is None:
        return args[0] if args else kwargs["input"]
    if scope.indices is None:
        raise RuntimeError(f"{type(module).__name__} did not call F.embedding on its own weight")
    return scope.indices


def _check(name: str, module: nn.Embedding) -> None:
    if module.sparse or module.scale_grad_by_freq or module.max_norm is not None:
        raise ValueError(f"{name}: per-sample gradients need a plain nn.Embedding (sparse, scale_grad_by_freq "
                         "and max_norm mix samples or rewrite the weight); turn those options off or freeze it")


@register(nn.Embedding, capture=_capture, scope=_scope, check=_check, factored=always, projectable=True,
          float_input=False)
def embedding(module: nn.Embedding, ids, grad_output) -> dict:
    """Row v of sample i's gradient is Σ_t [ids[i,t] = v]·G[i,t]: the factors (ids, G), never (B, vocab, D).
    F.embedding gives the padding row no gradient."""
    batch = grad_output.shape[0]
    ids = ids.reshape(batch, -1)
    g = batch_rows(grad_output, batch, module.weight.dtype)
    if module.padding_idx is not None:
        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
    return {"weight": Factored.outer(ids, g, rows=module.num_embeddings)}
