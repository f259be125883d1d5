"""Step time estimated from what a step dispatches (docs/plan.md, "How the time is estimated"): each aten op takes
the longer of its FLOPs at the device's peak rate and the bytes it reads and writes at its memory bandwidth, counted
on the meta device in a memory plan's own steps (dpmem.engine.planner), so it costs no GPU. Eager PyTorch also
spends host time on every op (roberta-base B = 32 on an H100: AdamW's 4,294 ops a step and dp-adam's 9,445 bound
the step, not the kernels), which `step_seconds` adds. FLOPs are torch's own formulas (`torch.utils.flop_counter`)
and `FLOPS`' for the kernels it has none for; every other op is elementwise or a reduction: bytes only. An estimate,
not a measurement, that errs fast (docs/plan.md says what it leaves out), least where the step is big matmuls."""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


@dataclass(frozen=True)
class Device:
    """A device's dense peaks (no structured sparsity): FLOP/s of matmuls per precision, and memory bandwidth."""
    name: str
    memory_gib: float
    fp32_tflops: float  # CUDA cores (and the fp32 attention kernels, which do not use TF32)
    tf32_tflops: float  # matmuls and convolutions under train.precision=tf32
    bandwidth_gbs: float  # GB/s = 1e9 bytes/s
    source: str
    # eager host time per dispatched op: dp-adam (bk) on an H100 host, roberta-base B = 32 T = 128 TF32, host-bound
    # at 358 samples/s and 9,445 ops a step (../shared/gpu-2026-11-24.md): 89 ms a step, 9.5 µs an op
    host_op_us: float = 9.5

    def matmul_flops(self, precision: str) -> float:
        return 1e12 * (self.tf32_tflops if precision == "tf32" else self.fp32_tflops)


DEVICES = {
    "h100": Device("h100", 80, 67.0, 494.7, 3350, "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column "
                   "(TF32 989 TFLOP/s is with sparsity: half dense)"),
    "h200": Device("h200", 141, 67.0, 494.7, 4800, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column "
                   "(TF32 989 TFLOP/s is with sparsity: half dense)"),
    "a100": Device("a100", 80, 19.5, 156.0, 2039, "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column"),
    "l4": Device("l4", 24, 30.3, 60.0, 300, "NVIDIA L4 Tensor Core GPU datasheet (TF32 120 TFLOP/s is with "
                 "sparsity: half dense)"),
}


@functools.cache
def measured_cpu() -> Device:
    """This host's CPU, measured now with torch's threads: a float32 matmul's FLOP/s and a large copy's bytes/s (the
    best of a few tries; a CPU has no datasheet peak that torch reaches)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    src = torch.empty(64 * 2**20)  # 256 MiB, beyond the caches
    dst = torch.empty_like(src)
    x = torch.ones(4)
    flops, moved, ops = [], [], []
    for _ in range(5):
        tic = time.perf_counter()
        a @ b
        flops.append(2 * 1024**3 / (time.perf_counter() - tic))
        tic = time.perf_counter()
        dst.copy_(src)
        moved.append(2 * src.nbytes / (time.perf_counter() - tic))
        tic = time.perf_counter()
        for _ in range(200):
            x.add_(1.0)
        ops.append((time.perf_counter() - tic) / 200)
    rate = max(flops) / 1e12
    return Device("cpu", math.inf, rate, rate, max(moved) / 1e9,
                  f"measured on this host ({torch.get_num_threads()} threads): a 1024² float32 matmul, a 256 MiB "
                  "copy, a 4-element add (host time per op)", host_op_us=1e6 * min(ops))


def device(name: str) -> Device:
    return measured_cpu() if name == "cpu" else DEVICES[name]


def _of_shapes(formula, n: int):
    """torch's `formula` over the shapes of the op's first `n` arguments (a kernel its registry does not list)."""
    return lambda *args, out_val=None, **kwargs: formula(*(a.shape for a in args[:n]))


def _per_element(position: int, flops: int = 2):
    """`flops` per element of the op's argument at `position`: 2 (a multiply-add) per matrix element of a
    matrix-vector product, per element of a dot product; the embedding's backward adds each gradient row into its
    token's row, 1 per gradient element."""
    return lambda *args, out_val=None, **kwargs: flops * args[position].numel()


FLOPS = {**flop_registry, aten.mv: _per_element(0), aten.addmv: _per_element(1), aten.dot: _per_element(0),
         aten.vdot: _per_element(0), aten.embedding_dense_backward: _per_element(0, 1),
         aten._scaled_dot_product_flash_attention_for_cpu: _of_shapes(sdpa_flop_count, 3),
         aten._scaled_dot_product_flash_attention_for_cpu_backward: _of_shapes(sdpa_backward_flop_count, 4)}
# attention kernels in float32 run on CUDA cores whatever train.precision says (TF32 is cuBLAS' and cuDNN's)
ATTENTION = {op for op in FLOPS if "attention" in str(op)}
FREE = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided, aten._unsafe_view,
        aten.lift_fresh, aten.detach}  # no bytes move: allocations and views that torch does not mark as views


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes an op reads from (or writes to) `t`: its elements once each, a broadcast (stride 0) dimension once."""
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        elements *= size if stride else 1
    return elements * t.element_size()


class OpCounter(TorchDispatchMode):
    """Counts, while active, every op dispatched, its FLOPs and bytes, and its roofline seconds on `device` at each
    of `precisions` (fp32, tf32: the plan's tensors are float32; the two differ in the matmuls' rate only).
    `by_op` keeps each op's share (seconds at the first precision, FLOPs, bytes), for the report."""

    def __init__(self, device: Device, precisions: tuple[str, ...] = ("fp32",)):
        super().__init__()
        self.rates = {p: device.matmul_flops(p) for p in precisions}
        self.first_rate = self.rates[precisions[0]]  # by_op's
        self.fp32_rate = device.matmul_flops("fp32")
        self.bandwidth = device.bandwidth_gbs * 1e9
        self.flops = self.bytes = self.ops = 0
        self.seconds = dict.fromkeys(precisions, 0.0)
        self.by_op: dict[str, list[float]] = {}  # op name: [seconds, flops, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        self.ops += 1
        if func.is_view or packet in FREE:
            return out
        formula = FLOPS.get(packet)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        moved = sum(tensor_bytes(t) for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
        streamed = moved / self.bandwidth
        for precision, rate in self.rates.items():
            self.seconds[precision] += max(flops / (self.fp32_rate if packet in ATTENTION else rate), streamed)
        self.flops += flops
        self.bytes += moved
        share = self.by_op.setdefault(str(packet).removeprefix("aten."), [0.0, 0, 0])
        share[0] += max(flops / self.first_rate, streamed)
        share[1] += flops
        share[2] += moved
        return out

    def summary(self) -> dict:
        return {"seconds": self.seconds, "flops": self.flops, "bytes": self.bytes, "ops": self.ops,
                "by_op": self.by_op}


def _extrapolated(one: float, two: float, micro_batches: int) -> float:
    """A step of `micro_batches` micro-batches from two counted steps, of one micro-batch and of two: each further
    micro-batch costs what the second one added."""
    return one + (micro_batches - 1) * (two - one)


def step_seconds(one: dict, two: dict, micro_batches: int, device: Device, precision: str, batch_size: int) -> dict:
    """The step's estimated seconds at `precision`: the device's (roofline), the host's (ops × host_op_us), and the
    step's, the longer of the two on a GPU (the host runs ahead of the device) and their sum on the CPU (one does
    both); and the samples/s of a step of `batch_size` samples, and the device-bound ones (train.compile's)."""
    on_device = _extrapolated(one["seconds"][precision], two["seconds"][precision], micro_batches)
    host = _extrapolated(one["ops"], two["ops"], micro_batches) * device.host_op_us * 1e-6
    step = on_device + host if device.name == "cpu" else max(on_device, host)
    return {"device_seconds": on_device, "host_seconds": host, "step_seconds": step,
            "flops": _extrapolated(one["flops"], two["flops"], micro_batches),
            "bytes": _extrapolated(one["bytes"], two["bytes"], micro_batches),
            "samples_per_s": batch_size / step, "device_bound_samples_per_s": batch_size / on_device}
