"""The generic rule for parameters that no layer rule owns (ViT's cls token and position embeddings, a module of your
own, nn.MultiheadAttention, the recurrent layers): replay the owning module's forward for one sample at a time (under
torch.func.vmap, or in a loop where vmap cannot: the recurrent kernels) and take the vector-Jacobian product with
that sample's output gradients. Exact for any module whose forward treats samples independently and uses no
randomness; the attribution proof (`dpmem.methods.attribution`) checks the first.

Which dimension of each input and output is the batch: by default the leading one, where it has B rows (an input
without is passed whole to every sample; an output with one row is shared by the batch and broadcast to B rows by
the taps); a layer type whose batch is elsewhere registers a `Replay` (`rules/multihead_attention.py`,
`rules/recurrent.py`)."""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

Dims = list  # per leaf of a pytree: its batch dimension, or None (passed whole / no gradient asked)


@dataclass(frozen=True)
class Replay:
    """How a layer type's forward is replayed per sample: `dims(name, module, args, kwargs, output_leaves, batch)` gives
    the batch dimension of each (args, kwargs) leaf and of each output leaf (None: no per-sample gradient asked),
    raising ValueError for a call it cannot split; `loop`: one autograd call per sample, where vmap has no rule."""
    dims: Callable[[str, nn.Module, tuple, dict, list, int], tuple[Dims, Dims]]
    loop: bool = False


REPLAYS: dict[type, Replay] = {}
# layer types of a library that dpmem does not import until a model does (its import costs every process seconds),
# by module and qualified name
REPLAYS_BY_NAME: dict[str, Replay] = {}


def replay_of(module: nn.Module) -> Replay | None:
    for t in type(module).__mro__:
        replay = REPLAYS.get(t) or REPLAYS_BY_NAME.get(f"{t.__module__}.{t.__qualname__}")
        if replay is not None:
            return replay
    return None


def check_deterministic(name: str, module: nn.Module) -> None:
    if module.training:
        for sub_name, sub in module.named_modules():
            if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
                raise ValueError(f"{name}: its per-sample gradient is computed by replaying {type(module).__name__}, "
                                 f"whose dropout {sub_name or '(self)'} has p={sub.p}; set that dropout to 0")


def capture_call(module, args, kwargs, output):
    detach = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731
    return tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()}


def named_dims(forward, args: tuple, kwargs: dict, table: dict) -> Dims:
    """The batch dimension of each (args, kwargs) leaf, in tree_flatten's order, from a table by `forward`'s parameter
    names (a tensor leaf not in it, and every other leaf, None: passed whole)."""
    names = list(inspect.signature(forward).parameters)[1:]
    dims = []
    for key, value in [*zip(names, args), *kwargs.items()]:
        dims += [table.get(key) if isinstance(leaf, torch.Tensor) else None for leaf in tree_flatten(value)[0]]
    return dims


def leading_dims(name: str, module: nn.Module, args: tuple, kwargs: dict, outputs: list, batch: int):
    """The default: an input's batch is its leading dimension where that has B rows, else its second where that has
    (time-major, three dimensions or more), else it is passed whole; an output's likewise, or its leading dimension
    where it has 1 row shared by the batch (`owners.SHARED`: broadcast to B by the taps); a float output read
    neither way is refused (its rows are not samples)."""
    def batched(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return None
        return 0 if x.shape[0] == batch else 1 if x.dim() >= 3 and x.shape[1] == batch else None
    ins = [batched(x) for x in tree_flatten((args, kwargs))[0]]
    outs = []
    for t in outputs:
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            outs.append(None)
        elif t.dim() and (t.shape[0] in (batch, 1) or batched(t) is not None):
            outs.append(0 if t.shape[0] in (batch, 1) else 1)
        else:
            raise ValueError(f"{name}: {type(module).__name__}'s output has shape {tuple(t.shape)} for a batch of "
                             f"{batch}: its leading dimension is neither the batch nor 1 (shared by the batch), so "
                             "its rows are not samples; its gradient cannot be split by sample: "
                             f"{freeze_fix('its parameters', name + '.*')}")
    return ins, outs


def fallback_grads(module: nn.Module, names: list[str], call: tuple, grad_outputs: list, dims: tuple[Dims, Dims],
                   batch: int, loop: bool = False,
                   fixed: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Per-sample gradients (B, *shape) of `module`'s parameters `names` (dotted below it), from its captured call,
    the gradients of its output leaves (one per leaf whose dimension in `dims` is not None, None where it reached
    no loss) and the batch dimension of each input and output leaf. `fixed`: values for any of its (sub)modules'
    parameters in place of theirs (FSDP's shards gathered whole, as the forward saw them)."""
    in_dims, out_dims = dims
    leaves, spec = tree_flatten(call)
    fixed = fixed or {}
    params = {n: fixed[n] if n in fixed else module.get_parameter(n).detach() for n in names}
    fixed = {n: t for n, t in fixed.items() if n not in params}
    asked = [j for j, d in enumerate(out_dims) if d is not None]
    dtype = next(iter(params.values())).dtype
    grads = [torch.zeros(()) if g is None else g.to(dtype) for g in grad_outputs]  # None: a leaf no loss reached
    g_dims = [None if g is None else out_dims[j] for j, g in zip(asked, grad_outputs)]

    def sample_loss(p, sample_leaves, gs):
        one = [x.unsqueeze(d) if d is not None else x for x, d in zip(sample_leaves, in_dims)]
        args, kwargs = tree_unflatten(one, spec)
        out = tree_flatten(functional_call(module, {**fixed, **p}, args, kwargs))[0]
        terms = [(out[j] * g.unsqueeze(d)).sum() for j, g, d in zip(asked, gs, g_dims) if d is not None]
        return torch.stack(terms).sum()

    if not loop:
        # randomness="same" is safe: check_deterministic refused any dropout that is active.
        per_sample = vmap(grad(sample_loss), in_dims=(None, in_dims, g_dims), randomness="same")
        if torch.compiler.is_compiling():  # dynamo traces no warning filter (and warns nothing at run time)
            return per_sample(params, leaves, grads)
        with warnings.catch_warnings():  # ops vmap runs in a loop (MultiheadAttention's): the user cannot act on it
            warnings.filterwarnings("ignore", "There is a performance drop")
            return per_sample(params, leaves, grads)
    out = {n: [] for n in params}
    for i in range(batch):
        p = {n: t.detach().requires_grad_() for n, t in params.items()}
        pick = lambda xs, ds: [x.select(d, i) if d is not None else x for x, d in zip(xs, ds)]  # noqa: E731
        with torch.enable_grad():
            parts = torch.autograd.grad(sample_loss(p, pick(leaves, in_dims), pick(grads, g_dims)), list(p.values()),
                                        allow_unused=True)
        for n, g, t in zip(p, parts, p.values()):
            out[n].append(torch.zeros_like(t) if g is None else g)
    return {n: torch.stack(gs) for n, gs in out.items()}


def freeze_fix(what: str, pattern: str) -> str:
    """The fix of a layer whose gradient cannot be split by sample, spelt for both ways in: the API's and the CLI's
    (model.frozen)."""
    return f"freeze {what} (requires_grad_(False); in dpmem train: model.frozen=[{pattern}])"
