"""Which module owns each trainable parameter's per-sample gradient, and by which rule (read by the taps, and by the
plans and checks that ask which layers a model's rules cover)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dpmem.persample import rules  # noqa: F401  (registers the layer rules)
from dpmem.persample.factored import Factored
from dpmem.persample.fallback import freeze_fix, replay_of
from dpmem.persample.registry import Rule, rule_for


@dataclass
class Owner:
    """A module whose direct parameters get per-sample gradients, and how."""
    name: str
    module: nn.Module
    # attribute name -> parameter (trainable, owned here: direct, or dotted below a replayed layer)
    params: dict[str, nn.Parameter]
    rule: Rule | None  # None = generic fallback (`dpmem.persample.fallback`)
    inner_calls: list = field(default_factory=list)  # the `InnerCall`s of its forwards running now (a subclass's own)


def find_owners(model: nn.Module) -> list[Owner]:
    """Every module that owns trainable parameters, layer rules first (so a tied weight owned by a Linear and an
    Embedding gets both rules), then the generic fallback for the rest. Raises ValueError for a parameter that
    nothing covers or a layer that mixes samples."""
    owners, claimed = [], set()  # claimed: the ids of the parameters owned so far
    modules = list(model.named_modules())  # a shared module is listed once; its capture acts per use
    for mod_name, module in modules:  # frozen or not: in training mode it normalises by the batch's statistics
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ValueError(f"{mod_name}: {type(module).__name__} mixes samples (it normalises by the batch's "
                             "statistics in training mode, frozen or not); replace it (e.g. GroupNorm/LayerNorm)")
    # a layer replayed whole (nn.MultiheadAttention, the recurrent ones) owns its submodules' parameters too: its
    # forward reads them itself (MultiheadAttention's out_proj is a Linear it never calls)
    replayed = [(n, m) for n, m in modules if replay_of(m) is not None]
    inside = lambda name: any(name.startswith(f"{r}.") for r, _ in replayed)  # noqa: E731
    for mod_name, module in replayed:
        if inside(mod_name):
            continue
        own = {n: p for n, p in module.named_parameters() if p.requires_grad and id(p) not in claimed}
        if own:
            claimed.update(id(p) for p in own.values())
            owners.append(Owner(mod_name, module, own, None))
    for with_rule in (True, False):
        for mod_name, module in modules:
            rule = rule_for(module)
            if (rule is not None) != with_rule or replay_of(module) is not None or inside(mod_name):
                continue
            if rule is None and type(module).forward is nn.Module.forward:
                continue  # a container (ParameterDict) has no forward to replay: its parameters stay unclaimed
            own = {n: p for n, p in module.named_parameters(recurse=False)
                   if p.requires_grad and (with_rule or id(p) not in claimed)}
            if not own:
                continue
            if rule is not None and rule.check is not None:
                rule.check(mod_name, module)
            claimed.update(id(p) for p in own.values())
            owners.append(Owner(mod_name, module, own, rule))
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in claimed]
    if missing:
        raise ValueError(f"no per-sample rule covers {missing[0]}; add a rule or {freeze_fix('it', missing[0])}")
    return owners


def owned_parameters(owners: list[Owner]) -> list[nn.Parameter]:
    """Each owned parameter once, in the owners' order."""
    return list({id(p): p for owner in owners for p in owner.params.values()}.values())


def tensor_output(owner: Owner, output) -> torch.Tensor:
    """A rule-covered layer's output, checked to be a tensor (its rule reads the output's gradient)."""
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"{owner.name}: {type(owner.module).__name__} returns {type(output).__name__}, not a tensor; "
                         f"no per-sample rule covers its parameters {', '.join(owner.params)}; add a rule or freeze "
                         "them")
    return output


SHARED = "shared"  # a layout: the output's leading dimension is 1, broadcast over the batch (BERT's position ids)
TIME_MAJOR = "time-major"  # a layout: (T, B, ...), the batch second (nn.Transformer's and seq-first RNNs' layers)


def layout(owner: Owner, output: torch.Tensor, batch: int, batch_major: bool = False) -> str | int:
    """How a layer's output is read per sample: 1 (batch-first, B rows), `SHARED` (one row that the batch shares:
    each sample's gradient is taken through its own copy, `Taps` broadcasting the output to B rows), `TIME_MAJOR`
    ((T, B, ...), three dimensions or more) or k > 1 (B·k rows, batch-major: OPT's FFN on B·T tokens). An output
    that reads both ways ((B·k, B, ...): Swin's B·windows windows of B positions) is time-major unless
    `batch_major`; the attribution proof (`dpmem.methods.attribution`) tells which, and tells those from rows that
    are not samples at all. Raises ValueError, naming the layer, for any other leading dimension: an input with no
    batch dimension, whose rows every sample uses (T5's position buckets)."""
    rows = output.shape[0] if output.dim() else None
    if rows == batch:
        return 1
    if rows == 1:
        return SHARED
    if output.dim() >= 3 and output.shape[1] == batch and not (batch_major and ambiguous(output, batch)):
        return TIME_MAJOR
    if rows is not None and owner.rule is not None and rows % batch == 0:
        return rows // batch
    raise ValueError(f"{owner.name}: {type(owner.module).__name__}'s output has shape {tuple(output.shape)} for a "
                     f"batch of {batch}: its leading dimension is neither the batch, 1 (shared by the batch) nor B·k "
                     "rows, so its input has no batch dimension and every sample uses all of it; its gradient cannot "
                     f"be split by sample: {freeze_fix('its parameters', owner.name + '.*')}")


def ambiguous(output: torch.Tensor, batch: int) -> bool:
    """Whether a layer's output reads both time-major and as B·k batch-major rows (`layout`)."""
    rows = output.shape[0]
    return output.dim() >= 3 and output.shape[1] == batch and rows != batch and rows % batch == 0


def batch_first(owner: Owner, saved, grad_output: torch.Tensor, batch: int, read: str | int):
    """A rule-covered layer's input and output gradient with the batch dimension first, as its output was read
    (`layout`): time-major (T, B, ...) transposed and B·k batch-major rows unflattened to (B, k, ...), as views; a
    shared input (leading dimension 1; its output gradient is the broadcast copies', B rows) expanded to B rows as a
    view, not copied."""
    if read == TIME_MAJOR:
        return saved.transpose(0, 1), grad_output.transpose(0, 1)
    if read != 1 and read != SHARED:
        unflat = lambda t: t.reshape(batch, t.shape[0] // batch, *t.shape[1:])  # noqa: E731
        return unflat(saved), unflat(grad_output)
    if isinstance(saved, torch.Tensor) and saved.dim() and saved.shape[0] == 1 and batch > 1:
        saved = saved.expand(batch, *saved.shape[1:])
    return saved, grad_output


def tied_sum(a, b):
    """Two uses' per-sample gradients of one tied weight: factored + factored stays factored; otherwise the sum
    is dense, formed in one of the rules' fresh dense tensors in place (a copy would be another B×rows×cols)."""
    if isinstance(a, Factored) and isinstance(b, Factored):
        return a + b
    dense, other = (b, a) if isinstance(a, Factored) else (a, b)
    if not dense.is_contiguous():  # a broadcast view cannot be added into
        return other + dense
    return other.add_to_(dense) if isinstance(other, Factored) else dense.add_(other)
