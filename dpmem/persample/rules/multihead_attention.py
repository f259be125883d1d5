"""nn.MultiheadAttention (nn.TransformerEncoder's, torchvision's VisionTransformer's): replayed per sample under vmap
(`dpmem.persample.fallback`), its packed in-projection, bias_kv and out_proj included, with its batch in dimension 0
(batch_first) or 1 for query, key, value and the attention output, 0 for key_padding_mask and the weights."""

from torch import nn

from dpmem.persample.fallback import REPLAYS, Replay, named_dims


def _dims(name: str, module: nn.MultiheadAttention, args: tuple, kwargs: dict, outputs: list, batch: int):
    named = {**dict(zip(["query", "key", "value", "key_padding_mask", "need_weights", "attn_mask"], args)), **kwargs}
    if named["query"].dim() != 3:
        raise ValueError(f"{name}: MultiheadAttention called on unbatched (2-D) inputs has no batch to split; give "
                         "it batched ones")
    mask = named.get("attn_mask")
    if mask is not None and mask.dim() == 3:
        raise ValueError(f"{name}: a 3-D attn_mask holds B·heads rows batch-major, which the replay does not split; "
                         "give a 2-D mask (shared by the batch) or a key_padding_mask")
    seq = 0 if module.batch_first else 1
    ins = named_dims(nn.MultiheadAttention.forward, args, kwargs,
                     {"query": seq, "key": seq, "value": seq, "key_padding_mask": 0})
    return ins, [d if getattr(t, "requires_grad", False) else None for d, t in zip([seq, 0], outputs)]


REPLAYS[nn.MultiheadAttention] = Replay(_dims)
