"""train.compile: a method's step functions compiled whole (`torch.compile(fullgraph=True)`), and how the step was
captured (graphs, graph breaks, recompiles, compile seconds) for the run's summary.

fullgraph=True makes any graph break an error, so "one graph" is checked on every call rather than hoped for.
dynamic=False: train.compile implies train.static_shapes, so every micro-batch has one shape and a new shape is a
recompile that `capture()` counts. `train.compile_backend=aot_eager` or `eager` trace the same graph without
generating code (the tests'); inductor's options on CUDA and on the CPU are `Compiler`'s."""

from __future__ import annotations

import time
from typing import Callable

import torch

from dpmem.config import ConfigError

# torch._dynamo is imported where a step compiles: it costs 2.3 CPU-s of each `dpmem` process's start-up
# (torch's own import is 2.0), and most runs never compile

BACKENDS = ("inductor", "aot_eager", "eager")


def _stats() -> tuple[int, int]:
    """(graphs made, graph breaks met) in this process so far."""
    import torch._dynamo.utils

    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _own_code(fn: Callable) -> Callable:
    """`fn` called through a function with a code object of its own. Dynamo keeps compiled graphs, and counts
    recompiles against its limit, per code object: without this, every run in one process (a sweep on Hydra's basic
    launcher, the tests) would add its graphs to the same `Privatizer.microbatch` until the limit refused one."""
    def call(*args, **kwargs):
        return fn(*args, **kwargs)
    call.__code__ = call.__code__.replace()
    return call


def _owner_guards_dropped(entries) -> list[bool]:
    """Dynamo's guards, less those on the compiled method's owner (`fn.__self__`: the Privatizer or method, and
    through it the model's modules, hooks and attributes) but for the parameters' tensor checks and the modules'
    `training` flags. A run's owner and model keep their structure from the step that compiles to the last (dpmem
    builds them, and nothing replaces a layer, hook or plan mid-run), and the guard tree over a model's modules
    costs more host time per call than the rest of the step (7,600 guards for 12 tiny blocks: 2 ms of a 12 ms step).
    The arguments (batch, sums, draws, projections) and globals keep every guard: a new shape recompiles."""
    return [not entry.name.startswith("fn.__self__") or entry.guard_type == "TENSOR_MATCH"
            or "training" in entry.name for entry in entries]


class Compiler:
    """Compiles functions for one run and records their capture. `compiler(fn, name)` is `fn` compiled; its calls
    that compile (a graph is made) count their wall time as compile seconds."""

    def __init__(self, device: torch.device, backend: str = "inductor", tf32: bool = False):
        if backend not in BACKENDS:
            raise ValueError(f"compile backend {backend!r}: allowed {', '.join(BACKENDS)}")
        self.backend = backend
        # the run's matmuls in TF32 (train.precision=tf32): a graph runs in the mode it was compiled in, so the
        # private arithmetic is left out of graphs (`Privatizer.compile`)
        self.tf32 = tf32
        # On CUDA, inductor replays CUDA graphs (what mode="reduce-overhead" asks for; torch.compile takes a mode or
        # options, not both, and the guard filter is an option). A graph replays into static output buffers: a
        # function's output is overwritten by its next call, so a caller that keeps one across calls (a sum over
        # micro-batches) keeps a copy.
        self.reuses_outputs = device.type == "cuda" and backend == "inductor"
        # On the CPU the host time of a small step is inductor's Python wrapper, a call per kernel, matmul and
        # view (1.6 ms of a 5 ms host-bound step): a C++ wrapper runs it instead. Built apart from the kernels, at
        # -O2: about 15 s more to compile from a fresh cache, where one build with the kernels at -O3 takes minutes
        # more (docs/benchmarks/index.md).
        self.options = ({"triton.cudagraphs": True} if self.reuses_outputs
                        else {"cpp_wrapper": True, "cpp_wrapper_build_separate": True,
                              "aot_inductor.compile_wrapper_opt_level": "O2"} if backend == "inductor" else {})
        self.functions: dict[str, int] = {}  # name -> graphs made for it
        self.breaks, self.seconds = 0, 0.0

    def __call__(self, fn: Callable, name: str) -> Callable:
        import torch._dynamo

        compiled = torch.compile(_own_code(fn), fullgraph=True, dynamic=False, backend=self.backend,
                                 options={"guard_filter_fn": _owner_guards_dropped, **self.options})
        self.functions[name] = 0

        def call(*args, **kwargs):
            before, tic = _stats(), time.perf_counter()
            # the per-sample backward runs inside the graph (`dpmem.persample.taps`): dynamo traces autograd.grad;
            # a checkpointed block's taps record in the forward and not again in its recompute
            try:
                with torch._dynamo.config.patch(trace_autograd_ops=True,
                                                 skip_fwd_side_effects_in_bwd_under_checkpoint=True):
                    out = compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:  # before the step releases anything
                # fullgraph: a graph break (a forward that logs), or a graph the backend cannot lower (T5's
                # classifier, whose end-of-sequence rows have a data-dependent count)
                what = "trace as one graph" if isinstance(e, torch._dynamo.exc.Unsupported) else "compile"
                why = str(e).strip().splitlines()[0]
                raise ConfigError("train.compile", f"the step does not {what} ({why}); this model trains eager: "
                                  "train.compile=false") from e
            after = _stats()
            if after[0] > before[0]:  # this call traced (and compiled) a graph
                self.seconds += time.perf_counter() - tic
            self.functions[name] += after[0] - before[0]
            self.breaks += after[1] - before[1]
            return out
        return call

    def capture(self) -> dict:
        """The summary's record of how the step was captured."""
        graphs = sum(self.functions.values())
        return {"backend": self.backend, "cuda_graphs": self.reuses_outputs,
                "graphs_per_function": dict(self.functions), "graphs": graphs, "graph_breaks": self.breaks,
                "recompiles": graphs - sum(1 for n in self.functions.values() if n),  # graphs beyond each first
                "compile_seconds": round(self.seconds, 2)}
