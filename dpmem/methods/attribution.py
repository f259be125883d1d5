"""The private methods' proof, before anything is released, that each per-sample gradient is its own sample's.

dpmem forms gᵢ for every sample i from a layer's captured input and output gradient (`dpmem.persample`). Rules can
be fooled: a batch-free input read as batch-major rows (T5's position buckets at a batch that divides them), a
module that mixes samples (a batch statistic), a loss that does (`losses.mean().expand(B)`), a weight used outside
its module. Then one record moves other records' clipped terms, the sensitivity is not C and ε does not hold.

The check: public random weights w (N(0, 1), from a fixed seed: they are not secret and release nothing), and

    Σᵢ wᵢ gᵢ  (dpmem's per-sample gradients, from the same captured factors the plan clips)  =  ∇ Σᵢ wᵢ ℓᵢ  (autograd)

per parameter. Both sides are linear in w, and the per-sample gradients do not depend on w, so equality at a random
w holds for every w (with probability 1), and so gᵢ = ∇ℓᵢ for each i. It costs one backward pass of Σᵢ wᵢ ℓᵢ on the
first micro-batch, and again on a micro-batch whose layers are read differently (`Tape.layouts`: a new signature).

On a mismatch `explain` says why: where samples mix (the last layer output whose gradient rows reach other samples'
losses, and what follows it), a layer read as batch-major rows that are not the samples', or, where neither, a use
outside the owning module.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

import torch
from torch import nn

from dpmem import distributed, sharding
from dpmem.persample.fallback import freeze_fix
from dpmem.precision import Compute

ROUNDING_BAND = 8  # differences up to this many tolerances are rounding that ran long, not a wrong attribution
SEED = 20260521  # the weights' public seed: any fixed value; the check's power needs only that w is not chosen to fit


def public_weights(n: int, device: torch.device) -> torch.Tensor:
    """n weights N(0, 1), the same on every call and every rank (a CPU generator of a fixed seed): zero-mean, so
    Σᵢ wᵢ gᵢ has no large common part beside which a misattributed row would be lost in rounding."""
    return torch.randn(n, generator=torch.Generator().manual_seed(SEED), dtype=torch.float64).to(device)


def tolerance(compute: Compute) -> float:
    """The relative difference rounding explains: a batch gradient rounds its inputs (TF32) or its output (bf16)
    once; float32 sums of thousands of terms in other orders differ by up to 1e-3 elementwise. Zero-mean weights keep
    that relative: both sides are sums of B terms of random sign, so their rounding and their size grow alike."""
    return max(4 * compute.unit_roundoff, 1e-3)


def verify_attribution(model: nn.Module, params: list[nn.Parameter], totals: dict[nn.Parameter, torch.Tensor],
                       transform: Callable[[nn.Parameter, torch.Tensor], torch.Tensor] | None = None,
                       compute: Compute = Compute(), explain: Callable[[list[str]], str] | None = None) -> None:
    """While autograd's gradients of Σᵢ wᵢ ℓᵢ are in `.grad`: the per-sample gradients' weighted sums `totals`
    (Σᵢ wᵢ gᵢ per parameter) must equal them (after `transform`, e.g. a projection). Clears the `.grad`s; skipped on
    meta. A difference within a few times rounding (`tolerance`) is a warning; a larger one raises RuntimeError with
    `explain(names of the parameters that differ)`."""
    pairs = [(p, p.grad, totals.get(p)) for p in params]
    for p in params:
        p.grad = None
    if not params or params[0].device.type == "meta":
        return
    if any(sharding.is_sharded(g) for _, g, _ in pairs):  # FSDP: the batch gradient is the sum over the ranks
        distributed.sum_(t for _, _, t in pairs if t is not None)
        pairs = [(p, None if g is None else sharding.full(g), t) for p, g, t in pairs]
    names = {p: n for n, p in model.named_parameters()}
    tol = tolerance(compute)
    # a parameter whose gradient is not finite (diverged weights) proves nothing and sets no scale: the trainer's
    # non-finite check ends such a run; every finite one is still compared
    finite = [(p, b, t) for p, b, t in pairs if b is not None and bool(b.isfinite().all())]
    # a parameter that reached the loss where no tap saw it (DeBERTa's relative-position table, read as .weight): its
    # per-sample gradients are missing, however small its gradient
    wrong = [names[p] for p, b, t in finite if t is None and bool(b.any())]
    # each parameter's rounding is measured against the largest gradient entry of its module: a rule forms all of
    # a module's per-sample gradients from the same captured factors, so a gradient that vanishes analytically (a key
    # projection's bias) rounds at the scale of its module's weight. Not against the whole model's: a misread small
    # layer (a LayerNorm over a shared table) would pass within that. tol × the model's largest entry is the least
    # scale, so that a module whose every gradient vanishes is not held to below rounding.
    least = tol * max((float(torch.linalg.vector_norm(b, float("inf"))) for _, b, _ in finite), default=0.0)
    modules: dict[str, list[nn.Parameter]] = {}
    for p, _, t in finite:
        if t is not None:
            modules.setdefault(names[p].rpartition(".")[0], []).append(p)
    grads = {p: b for p, b, _ in finite}
    for params_of_module in modules.values():  # one module's gradients at a time: no copy of the whole gradient
        wants = [(transform(p, grads[p]) if transform is not None else grads[p]).float() for p in params_of_module]
        floor = 0.1 * tol * max([least, *(float(torch.linalg.vector_norm(w, float("inf"))) for w in wants)])
        for p, wanted in zip(params_of_module, wants):
            wrong += _differs(names[p], totals[p].float(), wanted, floor, tol, compute)
    if wrong:
        why = explain(wrong) if explain is not None else used_outside(wrong)
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise RuntimeError(f"the per-sample gradients of {wrong[0]}{more} are not each sample's own (Σᵢ wᵢ gᵢ differs "
                           f"from autograd's ∇Σᵢ wᵢ ℓᵢ by more than the {ROUNDING_BAND * tol:.1e} rounding explains): "
                           f"{why}")


def _differs(name: str, total: torch.Tensor, want: torch.Tensor, floor: float, tol: float,
             compute: Compute) -> list[str]:
    """[name] where Σᵢ wᵢ gᵢ (`total`) differs from autograd's (`want`) by more than rounding explains; a gap within
    ROUNDING_BAND times it is a warning."""
    if torch.allclose(total, want, rtol=tol, atol=floor):
        return []
    # the gap itself is a function of the private batch: compared here, printed nowhere
    if float((total - want).norm() / want.norm().clamp_min(floor)) > ROUNDING_BAND * tol:
        return [name]
    print(f"dpmem: warning: the per-sample gradients of {name} match autograd's beyond {compute.name} rounding's "
          f"usual {tol:.1e} but within {ROUNDING_BAND} times it: rounding, not a wrong attribution; training goes on",
          file=sys.stderr)
    return []


def used_outside(names: list[str]) -> str:
    return (f"{names[0]} is used outside the module that owns it (or by a forward its rule does not model); add a "
            f"rule for that module, or {freeze_fix('it', names[0])}")


def rows_misread(layouts: dict[str, int], names: list[str]) -> str | None:
    """The failing parameters' layers whose output's B·k rows were read as batch-major, if any (`owners.layout`):
    the first named, and the fix for all of them (T5's encoder and decoder position biases, in one line)."""
    modules = list(dict.fromkeys(name.rpartition(".")[0] for name in names))
    misread = [m for m in modules if isinstance(layouts.get(m), int) and layouts[m] > 1]
    if not misread:
        return None
    first, more = misread[0], misread[1:]
    alike = f" (and {', '.join(more)} alike)" if more else ""
    return (f"{first}'s output has {layouts[first]}·B rows, which are not B samples' rows batch-major (its input has "
            f"no batch dimension: every sample uses all of it, as T5's position buckets){alike}; "
            f"{freeze_fix('their parameters' if more else 'its parameters', ','.join(m + '.*' for m in misread))}")


def where_samples_mix(model: nn.Module, forward: Callable[[], torch.Tensor], weights: torch.Tensor,
                      names: list[str]) -> str | None:
    """Where sample i's activations reach other samples' losses, found by one more forward of the micro-batch: for
    each module's (first tensor) input and output of B rows, whether the gradient of Σᵢ wᵢ ℓᵢ is w times that of
    Σᵢ ℓᵢ row by row (a row that reaches only its own loss). The last call whose output fails, and the first later
    call whose output passes: that module mixes (its input failed), or the code between them in their common
    parent's forward does; or, where the last is the layer of a parameter that differs (`names`) and takes no float
    input of B rows, its rows are not samples at all. None where every row passes (the mixing is not in
    activations: a shared weight)."""
    batch = weights.shape[0]
    calls: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []

    def rows(x):
        x = next((t for t in x if isinstance(t, torch.Tensor)), None) if isinstance(x, (tuple, list)) else x
        ok = isinstance(x, torch.Tensor) and x.requires_grad and x.dim() and x.shape[0] == batch
        return x if ok else None

    def keep(name, module, args, kwargs, output):
        calls.append((name, rows((*args, *kwargs.values())), rows(output)))

    hooks = [m.register_forward_hook(functools.partial(keep, n), with_kwargs=True) for n, m in model.named_modules()]
    try:
        with torch.enable_grad():
            losses = forward()
    finally:
        for h in hooks:
            h.remove()
    tensors = list({id(t): t for _, i, o in calls for t in (i, o) if t is not None}.values())
    if not tensors:
        return None
    w = weights.to(losses.dtype)
    plain = torch.autograd.grad(losses.sum(), tensors, retain_graph=True, allow_unused=True)
    weighted = torch.autograd.grad((losses * w).sum(), tensors, allow_unused=True)
    mixed = {}
    for t, g, gw in zip(tensors, plain, weighted):
        if g is not None and gw is not None:
            own = w.view(-1, *[1] * (g.dim() - 1)) * g
            mixed[id(t)] = float((gw - own).norm()) > 1e-3 * float(own.norm()) + 1e-12
    bad = lambda t: t is not None and mixed.get(id(t), False)  # noqa: E731
    last = max((j for j, (_, _, o) in enumerate(calls) if bad(o)), default=None)
    if last is None:
        return None
    producer = calls[last][0] or type(model).__name__
    if calls[last][1] is None and any(n.rpartition(".")[0] == calls[last][0] for n in names):
        return (f"{producer}'s output has B rows that are not samples' (its input has no batch dimension: every "
                "sample uses all of its rows, as T5's position buckets where their number equals the batch); "
                f"{freeze_fix('its parameters', calls[last][0] + '.*')}")
    for name, inp, out in calls[last + 1:]:
        if out is None or bad(out):
            continue
        if bad(inp):
            return (f"{name} mixes samples: the gradient of its output is each sample's own, that of its input is not "
                    "(a batch statistic, or a tensor shared across the batch, in its forward); make it act on each "
                    "sample alone (e.g. GroupNorm or LayerNorm for a batch norm) or freeze every parameter before it")
        parent = _common_parent(calls[last][0], name)
        return (f"the forward of {parent or type(model).__name__} mixes samples between {producer} and {name} (the "
                f"gradient of {producer}'s output reaches other samples' losses; that of {name}'s is each sample's "
                "own); make that code act on each sample alone")
    return (f"the loss function mixes samples: loss[i] depends on other samples than i (from {producer}'s output on, "
            "the last layer, each row's gradient reaches other samples' losses: e.g. a batch mean broadcast, "
            "losses.mean().expand(B)); return each sample's own loss (reduction='none')")


def _common_parent(a: str, b: str) -> str:
    pa, pb = a.split(".") if a else [], b.split(".") if b else []
    common = []
    for x, y in zip(pa[:-1], pb[:-1]):
        if x != y:
            break
        common.append(x)
    return ".".join(common)
