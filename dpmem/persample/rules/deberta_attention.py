"""DeBERTa-v2's (and v3's) disentangled self-attention: replayed per sample under vmap (`dpmem.persample.fallback`),
its projections' per-sample gradients dense. Its code projects the relative-position table, (1, 2P, D) and shared by
the batch, with the tokens' Linear layers (or with its own) and repeats the result by the batch size itself, which
the Linear rule's broadcast of a shared output to B rows breaks; replayed one sample at a time, the repeat is by 1.
The table (the encoder's rel_embeddings and the LayerNorm over it) reaches every sample: the proof refuses it
trainable, naming it (freeze it)."""

from torch import nn

from dpmem.persample.fallback import REPLAYS_BY_NAME, Replay, named_dims

BATCHED = {"hidden_states": 0, "attention_mask": 0, "query_states": 0}  # relative_pos and rel_embeddings: shared


def _dims(name: str, module: nn.Module, args: tuple, kwargs: dict, outputs: list, batch: int):
    ins = named_dims(type(module).forward, args, kwargs, BATCHED)
    return ins, [0 if getattr(t, "requires_grad", False) else None for t in outputs]  # context; attention probs


REPLAYS_BY_NAME["transformers.models.deberta_v2.modeling_deberta_v2.DisentangledSelfAttention"] = Replay(_dims)
