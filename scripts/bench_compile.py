"""dpmem's compiled private step (train.compile) beside its eager one and its peers, interleaved in one process: torch
AdamW eager and compiled (the model compiled, as PyTorch users compile it), Opacus' per-sample hooks, and dpmem's
dp-adam (bk, and two-pass ghost, also with activation checkpointing) and grape, eager and compiled. At two shapes
of a RoBERTa classifier (embeddings frozen):

    host-bound      12 blocks, width 32,  B = 2,  T = 8
    compute-bound   4 blocks,  width 256, B = 16, T = 64

    python scripts/bench_compile.py                       # both shapes, 1 thread, inductor; docs/benchmarks/compile.md
    python scripts/bench_compile.py --shapes host-bound --steps 5 --threads 2
    python scripts/bench_compile.py --device cuda --shapes roberta-base --precision tf32     # and bf16

Each contestant is built and warmed up (dpmem's first step rehearses the attribution proof eagerly, then compiles: the
slowest warm-up step's time less a median step is the compile time, in a fresh inductor cache unless --warm-cache: what a new shape
costs, the headers inductor precompiles once built before any contestant); then `--steps` interleaved rounds of one
step each, medians taken. The peak of the eager contestants is the live-tensor counter's over one step (what
dpmem's memory planner plans to within its tolerance); a compiled step cannot run under that counter (dynamo refuses
a dispatch mode), so its peak is CUDA's to measure (`--device cuda`: torch.cuda.max_memory_allocated over one step).
Every private contestant runs with sigma = 1, C = 1 and AdamW."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import (ADAMW, Contestant, adamw, build, dpmem_method, make_batch, measure,  # noqa: E402
                         opacus_hooks, per_sample_loss, trainable)
from dpmem.compiling import Compiler  # noqa: E402
from dpmem.composition import CONF_DIR  # noqa: E402
from dpmem.data import build_data  # noqa: E402
from dpmem.methods.base import optimizer_state  # noqa: E402
from dpmem.precision import RunPrecision  # noqa: E402
from dpmem.report import benchmark_page, machine, page_header, write_markdown  # noqa: E402

SHAPES = {"host-bound": dict(layers=12, width=32, batch=2, seq=8),
          "compute-bound": dict(layers=4, width=256, batch=16, seq=64),
          "roberta-base": dict(layers=12, width=768, batch=32, seq=128, heads=12),  # the GPU's
          "tiny": dict(layers=1, width=32, batch=2, seq=4)}  # scripts/gpu_figures.py --tiny: the sequence runs
ADAMW_COMPILED = "torch AdamW (non-private), compiled"


def adamw_compiled(model, batch, backend="inductor") -> Contestant:
    """The model compiled (forward and AOT backward); torch's optimiser step compiled where it allows."""
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(trainable(model), lr=1e-4, foreach=True)
    opt_step = torch.compile(opt.step, backend=backend)

    def step():
        loss = per_sample_loss(compiled, batch).sum()
        loss.backward()
        opt_step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return Contestant(model, step, lambda: optimizer_state(opt))


def dpmem_compiled(cfg, data, model, batch, size, name, options, prec, device, backend, train=None) -> Contestant:
    c = dpmem_method(cfg, data, model, batch, size, name, options, prec, {**(train or {}), "compile": True})
    c.method.compile(Compiler(device, backend, prec.tf32))
    return c


def cold_inductor_cache(device: torch.device) -> str:
    """A fresh inductor cache for this run (compile times are then a first compile's), with the headers inductor
    precompiles once per cache (its kernels' and its C++ wrapper's) built by a throwaway function."""
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dpmem-bench-inductor-")
    x = torch.ones(4, device=device)
    for options in ({}, Compiler(device).options):
        torch.compile(lambda t: t.sin() + 1, fullgraph=True, options=dict(options))(x)
    torch._dynamo.reset()
    return cache


def contestants(cfg, data, batch, size, prec, device, backend) -> dict:
    dp = lambda m, n, o, t=None: dpmem_method(cfg, data, m, batch, size, n, o, prec, t)  # noqa: E731
    dpc = lambda m, n, o, t=None: dpmem_compiled(cfg, data, m, batch, size, n, o, prec, device, backend, t)  # noqa
    checkpointed = {"activation_checkpointing": True}
    return {ADAMW: lambda m: adamw(m, batch, prec), ADAMW_COMPILED: lambda m: adamw_compiled(m, batch, backend),
            "Opacus hooks": lambda m: opacus_hooks(m, batch, size, prec),
            "dpmem dp-adam (bk)": lambda m: dp(m, "dp-adam", {"clipping": "bk"}),
            "dpmem dp-adam (bk), compiled": lambda m: dpc(m, "dp-adam", {"clipping": "bk"}),
            "dpmem dp-adam (ghost)": lambda m: dp(m, "dp-adam", {"clipping": "ghost"}),
            "dpmem dp-adam (ghost), compiled": lambda m: dpc(m, "dp-adam", {"clipping": "ghost"}),
            "dpmem dp-adam (ghost), checkpointed": lambda m: dp(m, "dp-adam", {"clipping": "ghost"}, checkpointed),
            "dpmem dp-adam (ghost), checkpointed, compiled": lambda m: dpc(m, "dp-adam", {"clipping": "ghost"},
                                                                          checkpointed),
            "dpmem grape": lambda m: dp(m, "grape", {}),
            "dpmem grape, compiled": lambda m: dpc(m, "grape", {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["host-bound", "compute-bound"])
    ap.add_argument("--steps", type=int, default=7, help="timed interleaved rounds (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contestants", nargs="+", default=None, help="names as in the table (default: all)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--warm-cache", action="store_true", help="keep inductor's cache (compile times then say little)")
    ap.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default="fp32")
    ap.add_argument("--backend", choices=["inductor", "aot_eager", "eager"], default="inductor",
                    help="every compiled contestant's (eager: traced, not code-generated; the tiny sequence's)")
    ap.add_argument("--out", default=benchmark_page(__file__, "compile"),
                    help="the page to write (default: docs/benchmarks/compile.md)")
    args = ap.parse_args()
    started = time.time()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cache = None if args.warm_cache else cold_inductor_cache(device)
    sections = []
    for shape_name in args.shapes:
        s = SHAPES[shape_name]
        torch.manual_seed(0)
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose("config", overrides=[
                "model=roberta-base", "data=synthetic", f"data.seq_len={s['seq']}", "data.num_classes=2",
                "data.n_train=64", "model.head=classifier", f"model.arch.num_hidden_layers={s['layers']}",
                f"model.arch.hidden_size={s['width']}", f"model.arch.intermediate_size={4 * s['width']}",
                f"model.arch.num_attention_heads={s.get('heads', 2)}"])
        data = build_data(cfg.data, cfg.model)
        model = build(cfg, data, ("embeddings.",), {})
        state = model.state_dict()
        del model
        batch = make_batch(cfg, data, s["batch"], device)
        with RunPrecision(args.precision, device) as prec:
            peers = contestants(cfg, data, batch, s["batch"], prec, device, args.backend)
            makers = {name: (lambda make=peers[name]: make(build(cfg, data, ("embeddings.",), state, device)))
                      for name in args.contestants or list(peers)}
            # dpmem's warm-up: the step that rehearses the attribution proof eagerly (checkpointed: and an eager
            # forward that makes the compiled one's probes) and compiles, then compiled steps
            results = measure(makers, s["batch"], args.steps, device, False, warmup=4,
                              metered=lambda name: "compiled" not in name)
            for r in results.values():
                r["compile"] = max(r["warm"]) - statistics.median(r["times"])
        eager, compiled = results.get(ADAMW), results.get(ADAMW_COMPILED)
        lines = [f"### {shape_name}: {s['layers']} blocks, width {s['width']}, B = {s['batch']}, T = {s['seq']}", "",
                 "| contestant | samples/s | × AdamW eager | × AdamW compiled | compile (s) | peak (MiB) |",
                 "|---|---|---|---|---|---|"]
        for name, r in results.items():
            ratio = lambda base: f"{r['rate'] / base['rate']:.2f}" if base else "-"  # noqa: E731
            peak = f"{r['peak'] / 2**20:.1f}" if "peak" in r else "CUDA only"
            took = f"{r['compile']:.1f}" if "compiled" in name else "-"
            lines.append(f"| {name} | {r['rate']:.3g} | {ratio(eager)} | {ratio(compiled)} | {took} | {peak} |")
        sections.append("\n".join(lines))
    header = page_header("Compiled private step (train.compile)", machine(device, args.threads),
                         f"Precision {args.precision}; medians of {args.steps} interleaved steps after warm-up (CUDA: "
                         "consecutive, one contestant at a time); "
                         + ("inductor (CUDA: CUDA graphs)" if args.backend == "inductor" else f"backend {args.backend}")
                         + "; compile seconds "
                         + ("with inductor's cache warm." if args.warm_cache else "from a fresh inductor cache."),
                         started)
    write_markdown(args.out, header + "\n\n".join(sections) + "\n")
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
