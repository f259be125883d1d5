"""nn.RNN, nn.LSTM and nn.GRU, any number of layers, bidirectional or not, batch_first either way: replayed one
sample at a time by autograd (`dpmem.persample.fallback`; vmap has no rule for the recurrent kernels), with the batch
in dimension 0 (batch_first) or 1 for the input and output, 1 for the hidden states (h, and LSTM's c). A
PackedSequence is refused (its batch is interleaved by length), as is dropout between layers in training (each
replay would draw its own)."""

from torch import nn
from torch.nn.utils.rnn import PackedSequence

from dpmem.persample.fallback import REPLAYS, Replay, named_dims


def _dims(name: str, module: nn.RNNBase, args: tuple, kwargs: dict, outputs: list, batch: int):
    x = args[0] if args else kwargs["input"]
    kind = type(module).__name__
    if isinstance(x, PackedSequence):
        raise ValueError(f"{name}: {kind} fed a PackedSequence, whose batch is interleaved by length, has no "
                         "per-sample replay; pad the batch instead (and mask the padded steps in the loss)")
    if x.dim() != 3:
        raise ValueError(f"{name}: {kind} called on an unbatched (2-D) input has no batch to split; give it a batch")
    if module.training and module.dropout > 0:
        raise ValueError(f"{name}: {kind}'s dropout between layers (p={module.dropout}) would draw other masks in its "
                         "per-sample replay; set dropout=0")
    seq = 0 if module.batch_first else 1
    ins = named_dims(type(module).forward, args, kwargs, {"input": seq, "hx": 1})
    # outputs: the output (batch at `seq`), then h (and c): layers·directions × B × hidden
    return ins, [None if not getattr(t, "requires_grad", False) else seq if j == 0 else 1
                 for j, t in enumerate(outputs)]


REPLAYS[nn.RNNBase] = Replay(_dims, loop=True)
