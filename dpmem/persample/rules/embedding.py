"""nn.Embedding, and its subclasses with a forward of their own (OPT's learned positions derive their ids from the
attention mask; Gemma's word embedding scales the lookup by √d), whose ids and output are read at their F.embedding
call (`registry.inner_call`)."""

import torch.nn.functional as F
from torch import nn

from dpmem.persample.factored import Factored, batch_rows
from dpmem.persample.registry import always, register


def _check(name: str, module: nn.Embedding) -> None:
    if module.sparse or module.scale_grad_by_freq or module.max_norm is not None:
        raise ValueError(f"{name}: per-sample gradients need a plain nn.Embedding (sparse, scale_grad_by_freq "
                         "and max_norm mix samples or rewrite the weight); turn those options off or freeze it")


@register(nn.Embedding, call=F.embedding, check=_check, factored=always, projectable=True, float_input=False)
def embedding(module: nn.Embedding, ids, grad_output) -> dict:
    """Row v of sample i's gradient is Σ_t [ids[i,t] = v]·G[i,t]: the factors (ids, G), never (B, vocab, D).
    F.embedding gives the padding row no gradient."""
    batch = grad_output.shape[0]
    ids = ids.reshape(batch, -1)
    g = batch_rows(grad_output, batch, module.weight.dtype)
    if module.padding_idx is not None:
        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
    return {"weight": Factored.outer(ids, g, rows=module.num_embeddings)}
