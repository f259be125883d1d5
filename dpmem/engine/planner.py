"""Memory planning: real training steps of the real method code on the `meta` device (no weights, nothing
allocated) under the live-tensor counter, which gives the peak and what it is made of, in seconds, for any model
that has an architecture config. `device=cpu` (or cuda) runs the same steps on real tensors, to check the plan.

`memory.world_size=N` plans one rank of a `train.fsdp=true` run over N ranks: the same steps, on rank 0 of N
simulated in this process (`dpmem.sharding.simulated_ranks`: torch's fake process group and fake tensors), with
the rank's share of the logical batch. FSDP shards the state, and gathers and frees each block, as it would."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import time
from typing import Callable

import torch
from omegaconf import OmegaConf
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from transformers import StoppingCriteria, StoppingCriteriaList

from dpmem import sharding
from dpmem.config import ConfigError, enum_value
from dpmem.data import build_data, example_batch, users
from dpmem.data.bundle import Grouped
from dpmem.engine.assemble import Parts, assemble
from dpmem.engine.roofline import OpCounter
from dpmem.engine.trainer import accounting_of, eval_batch_size, run_length
from dpmem.metering import CUDA_BLOCK, LiveTensorCounter, labelled_forward, memory_label
from dpmem.methods import check_fsdp, method_class
from dpmem.models import build_model
from dpmem.privacy.record import PrivacyUnit
from dpmem.privacy.strategies import Strategy, make_strategy

# GPU memory is quoted in binary units whatever the suffix (a "24GB" card and an "80GB" H100 hold 24 and 80 GiB)
UNITS = {"b": 1, "kb": 2**10, "mb": 2**20, "gb": 2**30, "tb": 2**40,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text) -> int:
    """'24GB' or '24GiB' (both 24·2³⁰, as GPU sizes are quoted), '512MiB', or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower() or "b"
    try:
        value = float(match.group(1)) * UNITS[unit]
    except (AttributeError, KeyError, ValueError):
        raise ConfigError("memory.budget", f"{text!r}: give a size such as 24GB, 24GiB or 80e9") from None
    if not value > 0:
        raise ConfigError("memory.budget", f"{text!r} must be positive")
    return int(value)


class AttentionKernels(TorchFunctionMode):
    """On meta, scaled_dot_product_attention has no fused kernel and takes the math path, which keeps the
    B×H×T×T attention weights for backward; the target device's fused kernel keeps O(B·H·T). This routes meta
    calls to the kernel the target would pick: on cpu the one its own dispatcher picks (asked with stand-in
    tensors of the same shapes); on cuda, in fp32, memory-efficient attention unless grouped-query heads differ
    (CUDA's efficient kernel does not take enable_gqa; that case stays on the math path). The CPU flash kernel
    reads grouped-query heads from the shapes."""

    def __init__(self, target: str):
        super().__init__()
        self.target = target

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    def attention(self, *args, **kwargs):
        """scaled_dot_product_attention, on meta by the target's kernel."""
        if not (args[0].is_meta or isinstance(args[0], FakeTensor)):
            return _SDPA(*args, **kwargs)
        q, k, v, mask, dropout, causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
        signature = None if mask is None else (tuple(mask.shape), mask.dtype)
        if self.target == "cpu" and _cpu_flash(tuple(q.shape), tuple(k.shape), q.dtype, signature, dropout,
                                               causal, gqa):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout, causal, attn_mask=_additive(mask, q), scale=scale)[0]
        if self.target == "cuda" and not (gqa and q.shape[-3] != k.shape[-3]):
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, _additive(mask, q), q.requires_grad, dropout, causal, scale=scale)[0]
        return _SDPA(*args, **kwargs)

    # torch's own callers inside another torch function (F.multi_head_attention_forward, which nn.MultiheadAttention
    # and nn.TransformerEncoderLayer run) call it while this mode is off (a mode is off inside its handler): they
    # reach it through torch.nn.functional's global, routed here while the mode is on
    def __enter__(self):
        self._outer = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self.attention
        return super().__enter__()

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._outer
        return super().__exit__(*exc)


_SDPA = F.scaled_dot_product_attention  # torch's, whatever the mode has put in its place


# what a forward may ask of a tensor's values: a truth value, `x in tensor` (DeBERTa-v2's "is there padding?", before
# its warning of a missing attention mask), a number
VALUE_READS = (torch.Tensor.__bool__, torch.Tensor.__contains__, torch.Tensor.item)


class UnknownValues(TorchFunctionMode):
    """A meta tensor (or a simulated rank's fake tensor) has a shape but no values. A model that asks for one in its
    forward (transformers 5.17's `_ignore_causal_mask_sdpa` reads `bool(mask.sum() == mask.numel())`, "is there no
    padding?"; generate asks whether every sequence has finished; DeBERTa-v2 `pad_id in ids`) is told no: a truth
    value on meta is False, the branch that keeps an explicit mask (or generates on), which costs memory rather than
    saves it. A number (`.item()` of a non-boolean) has no safe guess: that is an error that names the fallback.
    `guessed` counts the answers given (the plan reports it)."""

    def __init__(self):
        super().__init__()
        self.guessed = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # every other call passes at the first test; a fake tensor made from a number has its value
        if func in VALUE_READS and args and _valueless(args[0]):
            if func is not torch.Tensor.item or args[0].dtype == torch.bool:
                self.guessed += 1
                return False
            raise ConfigError("memory.device", "meta: the model reads a number out of a tensor (.item()) in its "
                              "forward, which a meta plan has no values for; plan on real tensors: memory.device=cpu "
                              "(or cuda)")
        try:
            return func(*args, **(kwargs or {}))
        except NotImplementedError as e:  # an op whose output's size depends on values (T5's classifier selects its
            # end-of-sequence rows by a boolean mask): meta has no kernel for it
            if not any(_valueless(a) for a in args):
                raise
            found = re.search(r"aten::\w+|torch\.\w+", str(e))
            op = found[0] if found else getattr(func, "__name__", func)
            raise ConfigError("memory.device", f"meta: the model runs {op} in its forward, whose output's size "
                              "depends on tensor values, which a meta plan has none of; plan on real tensors: "
                              "memory.device=cpu (or cuda)") from None


def _valueless(t) -> bool:
    return getattr(t, "is_meta", False) or isinstance(t, FakeTensor) and t.constant is None


class FullLength(StoppingCriteria):
    """Ends a planned generation when its sequences reach `length` (prompt + data.max_new_tokens), the longest a
    real one runs, by raising `Reached`: on meta generate's own check "has every sequence finished?" is answered
    no (UnknownValues), so it would never stop. A real generation stops at the same call, and frees from there."""

    class Reached(Exception):
        pass

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] >= self.length:
            raise FullLength.Reached
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _additive(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The fused kernels' mask: the dispatcher turns a boolean one into an additive one of q's dtype first, and that
    copy is what their backward keeps."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention's arguments, by position or name, with its defaults."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


@functools.cache
def _cpu_flash(q_shape, k_shape, dtype, mask, dropout, causal, gqa) -> bool:
    """Would the CPU dispatcher run these shapes through its flash kernel? Asked with real CPU stand-ins."""
    q, k = torch.empty(q_shape, dtype=dtype, requires_grad=True), torch.empty(k_shape, dtype=dtype)
    m = None if mask is None else torch.empty(mask[0], dtype=mask[1])
    choice = torch._fused_sdp_choice(q, k, k, m, dropout, causal, enable_gqa=gqa)
    return choice == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value


def plan(cfg, batch_size: int | None = None, physical_batch_size: int | None = None, device: str | None = None,
         *, first_micro_batches: int | None = None, roofline: Callable[[], OpCounter] | None = None,
         account: bool = False) -> dict:
    """Run `cfg.memory.steps` steps of cfg's method on one logical batch of `batch_size` (default
    train.batch_size) split into physical micro-batches (default train.physical_batch_size), on `device`
    (default memory.device), metering every step after the first (which creates the optimiser state and runs
    one-off checks); then the run's evaluation (`_evaluation`). Returns the run's peak tensor bytes, the larger of
    training's and evaluation's, with its breakdown, and each part's.

    `first_micro_batches=k`: each step runs only its first k micro-batches, with every micro-batch's inputs on the
    device as a run has them; from the second micro-batch on, a step's peak repeats, so k = 2 plans a logical batch
    of any size at the cost of two micro-batches. `roofline`: the last two steps (at least 3 are run) are counted
    by a fresh counter each, with one micro-batch and with two (`dpmem.engine.roofline.step_seconds`). `account`:
    the plan carries σ (calibrated as the run would) and ε.

    Correlated noise (privacy.noise) is drawn as the run draws it; bandmf's b − 1 buffers are all held from the
    first metered step (`_fill_noise_buffers`), as a run holds them from its b-th step on, and `noise` says what one
    band costs (`dpmem.engine.chooser` extrapolates other b from it)."""
    t, m, mem = cfg.train, cfg.method, cfg.memory
    if enum_value(t.precision) == "bf16":  # tf32 rounds inside the matmuls: its tensors are fp32's
        raise ConfigError("train.precision", "memory is planned in float32: autocast has no meta backend, so a bf16 "
                          "plan would be a guess; allowed: fp32, tf32 (measure bf16 on a GPU: "
                          "scripts/validate_memory.py)")
    batch = batch_size or t.batch_size
    world = mem.world_size
    device = torch.device(device or enum_value(mem.device))
    if world > 1:
        check_fsdp(m)
        if device.type != "meta":
            raise ConfigError("memory.device", "a plan over memory.world_size ranks is simulated (meta); to measure "
                              "one, run torchrun --nproc_per_node=N -m dpmem train train.fsdp=true")
        device = torch.device("cpu")  # fake tensors, which FSDP takes (it refuses meta ones)
    elif world < 1:
        raise ConfigError("memory.world_size", f"{world} must be at least 1")
    per_rank = -(-batch // world)  # the fullest rank's part of the logical batch (its expected size, rounded up)
    physical = min(physical_batch_size or t.physical_batch_size or per_rank, per_rank)
    tic = time.perf_counter()
    torch.manual_seed(t.seed)
    data, _ = users.for_training(cfg.privacy, build_data(cfg.data, cfg.model), cfg.data.split_seed)
    strategy = noise_strategy(cfg, data.n_train)  # the run's, at its own logical batch (a budget search varies it)
    # ULS: a batch of users, k record slots each (`Grouped`): its sizes count users
    unit = PrivacyUnit.of(cfg.privacy)
    k = unit.k if unit.uls else None
    if k:  # a batch of more users than there are, refused as the run refuses it
        unit.terms(data.n_train, users.count(data), batch)
    # the run's mechanism (σ calibrated for its steps) where asked; else a stand-in, as σ changes no memory
    length = (dict(zip(("steps", "sampling"), run_length(cfg, users.count(data) if k else data.n_train)))
              if account and world == 1 else {})
    with torch.device("meta" if world > 1 else device):
        model = build_model(cfg.model, data, weights=False)
    target = enum_value(mem.target)
    # the stand-in noise's expected batch size is the planned one; fake tensors have no values to compare
    cfg = OmegaConf.merge(cfg, {"train": {"batch_size": batch}},
                          {"train": {"physical_batch_size": physical_batch_size}} if physical_batch_size else {},
                          {"method": {"check_coverage": False}} if world > 1 and "check_coverage" in m else {})
    evaluated = min(eval_batch_size(cfg.train), len(next(iter(data.test.values()), [])))  # a run's largest eval batch
    ranks = sharding.simulated_ranks(world) if world > 1 else contextlib.nullcontext()
    with ranks as mesh:
        if mesh is not None:
            model = model.to_empty(device=device)  # fake tensors, uninitialised
        parts = assemble(cfg, device, data, model, mesh=mesh, recompute=lambda: AttentionKernels(target),
                         mechanism_of=_drawing(strategy), **length)
        method = parts.method
        sizes = [physical] * (per_rank // physical) + ([per_rank % physical] if per_rank % physical else [])
        micro = [example_batch(data, size, device) if k is None else
                 Grouped(example_batch(data, size * k, device), k, torch.ones(size * k), device) for size in sizes]
        loss_fn = labelled_forward(parts.per_sample_loss)
        block = CUDA_BLOCK if target == "cuda" else 1
        run = micro[:first_micro_batches or len(micro)]
        metered = [(run, None)] * (mem.steps - 1)  # each metered step's micro-batches, and its op counter
        if roofline:
            metered = [(run, None)] * (max(mem.steps, 3) - 3) + [(run[:1], roofline()), (run[:2], roofline())]
        counted, steps = [ops for _, ops in metered if ops is not None], len(metered) + 1
        with AttentionKernels(target), UnknownValues() as unknown:
            method.step(run[:1] if roofline else run, loss_fn)  # (creates the state: unmetered)
            band = _fill_noise_buffers(parts.mechanism, block)
            counter = LiveTensorCounter(block).track_state(model, method)
            counter.track((v for mb in micro for v in mb.values()), "activations")  # the inputs
            _cuda_peaks(device)  # on a real GPU, its allocator's peaks from here on beside the count (validate_memory)
            with counter:
                for step, ops in metered:
                    with ops if ops is not None else contextlib.nullcontext():
                        method.step(step, loss_fn)
            training = {"peak_bytes": counter.peak, "breakdown": counter.peak_breakdown, **_cuda_peaks(device)}
            del micro, run, metered  # a run's micro-batches are gone when it evaluates
            evaluation = {**_evaluation(parts, evaluated, cfg.data.max_new_tokens, block), **_cuda_peaks(device)}
    # the run's peak: training's or evaluation's, whichever is larger (training's at a tie), and its breakdown
    part, top = max(("training", training), ("evaluation", evaluation), key=lambda p: p[1]["peak_bytes"])
    cuda = {key: max(training[key], evaluation[key]) for key in training if key.startswith("cuda_")}
    params = list(model.parameters())
    return {
        "method": m.name, "model": cfg.model.name, "data": cfg.data.name, "input_shape": list(data.input_shape),
        "batch_size": batch, "physical_batch_size": physical, "device": "meta" if world > 1 else device.type,
        "target": target, "world_size": world, "per_rank_batch_size": per_rank, "steps": steps,
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "peak_bytes": top["peak_bytes"], "breakdown": top["breakdown"], "peak_part": part,
        "training": training, "evaluation": evaluation,
        "rounding": f"{block}-byte blocks" if block > 1 else "exact bytes",
        "allocator_overhead": mem.allocator_overhead,
        "reserved_estimate_bytes": reserved_estimate(top["peak_bytes"], mem.allocator_overhead),
        "guessed_truth_values": unknown.guessed,  # asked of meta tensors in the steps and evaluation (UnknownValues)
        "micro_batches": len(sizes), "micro_batches_run": min(len(sizes), first_micro_batches or len(sizes)),
        "roofline": [ops.summary() for ops in counted] if counted else None,
        "privacy": (parts.mechanism.summary or None) if parts.mechanism is not None else None,
        "noise": None if strategy is None else {
            "strategy": strategy.name, "bands": strategy.bands, "buffers": strategy.buffers, "band_bytes": band,
            "most_bands": most_bands(strategy, data.n_train, t.batch_size)},
        "wall_s": time.perf_counter() - tic, **cuda,
    }


def noise_strategy(cfg, n: int) -> Strategy | None:
    """The correlated strategy a run of `cfg` over `n` records draws its noise with, its bands cut at its horizon as
    the run's are (`dpmem.privacy.calibrate.noise_terms`, which refuses groups smaller than a batch); None for
    independent noise."""
    noise = enum_value(cfg.privacy.get("noise", "independent"))
    if noise == "independent" or not method_class(cfg.method.name).spec.private:
        return None
    return make_strategy(*accounting_of(cfg, n)[0].noise)


def most_bands(strategy: Strategy, n: int, batch_size: int) -> int | None:
    """The most bands that change anything: bandmf's are cut at its horizon (the run's steps, or a projected
    method's refresh), and its cyclic groups, one per band, must each hold a logical batch. None for bisr."""
    return min(strategy.horizon, n // batch_size) if strategy.name == "bandmf" else None


def _drawing(strategy: Strategy | None):
    """assemble's `mechanism_of` that makes the plan's mechanism (a stand-in, or the run's) draw `strategy`'s noise,
    never restarting: a projected method's refresh empties bandmf's buffers for one step, and the plan is of the
    steps that hold them all."""
    if strategy is None:
        return None
    return lambda mechanism, model: dataclasses.replace(mechanism, strategy=strategy, restart=None)


def _fill_noise_buffers(mechanism, block: int) -> int | None:
    """bandmf keeps its last b − 1 noise vectors; after the plan's first step it has one. The others are made
    (`CorrelatedNoise.fill_buffers`), so that the metered steps hold what a run holds from its b-th step on.
    Returns one band's bytes, one vector per run of the release each rounded to `block`; None where nothing is
    kept."""
    noise = mechanism.correlated if mechanism is not None else None
    if noise is None or not noise.buffers:
        return None
    noise.fill_buffers()
    return sum(-(-kept[0].untyped_storage().nbytes() // block) * block for kept in noise.buffers.values())


def reserved_estimate(tensor_bytes: float, allocator_overhead: float) -> int:
    """What CUDA's caching allocator reserves for `tensor_bytes` of live tensors: × (1 + memory.allocator_overhead)."""
    return math.ceil(tensor_bytes * (1 + allocator_overhead))


def _evaluation(parts: Parts, size: int, max_new_tokens: int, block: int) -> dict:
    """The run's evaluation (dpmem.engine.trainer.evaluate, between steps): a batch of `size` test examples (copies
    of the first, at the split's full width) on the device and the task's work on it, its generation of
    `max_new_tokens` or else `predict`, in eval mode under no_grad, beside what the run keeps between steps
    (parameters, gradients, the method's state). A task that scores itself on the host (data=median) adds nothing."""
    data, model = parts.data, parts.model
    evaluates = "generate" if data.generate is not None else "predict" if data.score is None else "host"
    work = size > 0 and evaluates != "host"
    # made outside the count (which would see the test split that its copies are sliced from), counted as inputs
    batch = example_batch(data, size, parts.device, data.test) if work else {}
    counter = LiveTensorCounter(block).track_state(model, parts.method).track(batch.values(), "activations")
    model.eval()
    try:
        with counter, torch.no_grad(), memory_label("activations"), contextlib.suppress(FullLength.Reached):
            if work and evaluates == "predict":
                parts.call(data.predict, batch)
            elif work:
                stop = StoppingCriteriaList([FullLength(batch["input_ids"].shape[1] + max_new_tokens)])
                parts.call(functools.partial(data.generate, stopping_criteria=stop), batch)
    finally:
        model.train()
    return {"batch_size": size, "evaluates": evaluates,
            "max_new_tokens": max_new_tokens if evaluates == "generate" else 0,
            "peak_bytes": counter.peak, "breakdown": counter.peak_breakdown}


def _cuda_peaks(device: torch.device) -> dict:
    """CUDA's allocator peaks since the last call (then reset, so that the next part's are its own); none off CUDA."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    peaks = {"cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
             "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    torch.cuda.reset_peak_memory_stats(device)
    return peaks


SEARCH_LIMIT = 1 << 16  # largest_batch looks no further: a budget that holds this many is said to be capped


def largest_batch(cfg, budget: int | str, limit: int = SEARCH_LIMIT) -> tuple[int, dict | None]:
    """The largest batch up to `limit` (under ULS, up to the users), in one physical batch, whose run's reserved
    estimate (training's or evaluation's, the larger: the run must not run out of memory when it evaluates) fits
    `budget` (bytes, or a size as memory.budget takes it: '24GB'), and its plan; (0, plan at 1) if not even one
    example fits. Doubling, then bisection: memory grows with the batch (and so does evaluation's, at its default
    batch size, the physical one; a fixed train.eval_batch_size is a floor)."""
    fits = {}
    budget = parse_bytes(budget)
    if PrivacyUnit.of(cfg.privacy).uls:  # a ULS step samples users: at most all of them
        limit = min(limit, users.count(build_data(cfg.data, cfg.model)))

    def ok(b):
        fits[b] = plan(cfg, b, physical_batch_size=b)
        return fits[b]["reserved_estimate_bytes"] <= budget
    if not ok(1):
        return 0, fits[1]
    low = 1
    while low < limit and ok(min(2 * low, limit)):
        low = min(2 * low, limit)
    high = min(2 * low, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low, fits[low]
