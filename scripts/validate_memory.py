"""Check `dpmem memory` plans against a real device, as a markdown table.

    python scripts/validate_memory.py                                      # vit-tiny on digits, every method
    python scripts/validate_memory.py model=roberta-base data=synthetic train.batch_size=8 --methods dp-adam grape

On a GPU each configuration is planned on meta (target cuda) and then run for the same steps on CUDA, and the
table sets the plan beside torch.cuda.max_memory_allocated and max_memory_reserved (reset after the first,
unmetered step; the run is `dpmem.engine.planner.plan` on device cuda). Without a GPU it says so and compares the
meta plan with the same steps on real CPU tensors (live-tensor counter, exact bytes). Each configuration has a row
for its training steps and one for its evaluation (at train.eval_batch_size, null = the physical batch size; a
generation task's data.max_new_tokens generated), each part's peaks measured apart. Trailing key=value arguments
are dpmem overrides. Writes docs/benchmarks/validate-memory.md (`--out` writes elsewhere): on a GPU its page is headed
by the command, the GPU, torch version and date; without one it opens by saying so (the comparison it is for was not
made), then the same line.

`--run METHOD` adds one `dpmem train` run of METHOD (4 steps of Poisson batches at the logical batch size, physical
micro-batches of half of it padded to that size, then its final evaluation) beside its plan: on a GPU the run's
torch.cuda.max_memory_allocated from its second step to its end (training and evaluation) against the plan's peak;
on the CPU the live-tensor counter's training peak against the plan's training part.
"""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from dpmem.composition import CONF_DIR
from dpmem.engine.planner import plan
from dpmem.engine.trainer import run_training
from dpmem.report import benchmark_page, machine, page_header, provenance, write_markdown
from dpmem.report.memory import evaluated

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["adam", "dp-adam", "grape", "galore-dp-naive", "dp-sgd-rc",
                                                     "dpzero"])
    ap.add_argument("--checkpointing", choices=["off", "on", "both"], default="both",
                    help="train.activation_checkpointing for each method: off, on, or a row of each")
    ap.add_argument("--run", default=None, metavar="METHOD", help="also one dpmem train run of METHOD against its plan")
    ap.add_argument("--out", default=benchmark_page(__file__, "validate-memory"),
                    help="the page to write (default: docs/benchmarks/validate-memory.md)")
    args, overrides = ap.parse_known_args()
    started = time.time()
    gpu = torch.cuda.is_available()
    lines = []
    if gpu:
        lines += ["| method | part | plan MiB | allocated MiB | plan / allocated | reserved est. MiB | reserved MiB |",
                  "|---|---|---|---|---|---|---|"]
    else:
        lines += ["| method | part | plan on meta MiB | counted on CPU MiB | meta / CPU |", "|---|---|---|---|---|"]
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    for method, checkpointing in ((m, c) for m in args.methods for c in modes):
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose("config", overrides=[f"method={method}", f"train.activation_checkpointing={checkpointing}",
                                               *overrides] + ([] if gpu else ["memory.target=cpu"]))
        planned = plan(cfg, device="meta")
        method = method + (" + checkpointing" if checkpointing else "")
        if gpu:
            # the earlier rows' cached blocks go back to the device, so that this row's reserved figure is its own
            gc.collect()
            torch.cuda.empty_cache()
        real = plan(cfg, device="cuda" if gpu else "cpu")
        for part in ("training", "evaluation"):
            mine, theirs = planned[part], real[part]
            name = part if part == "training" else f"evaluation, B {evaluated(mine)}"
            if gpu:
                allocated = theirs["cuda_max_allocated_bytes"]
                estimate = math.ceil(mine["peak_bytes"] * (1 + planned["allocator_overhead"]))
                lines.append(f"| {method} | {name} | {mine['peak_bytes'] / MIB:.1f} | {allocated / MIB:.1f} | "
                             f"{mine['peak_bytes'] / allocated:.3f} | {estimate / MIB:.1f} | "
                             f"{theirs['cuda_max_reserved_bytes'] / MIB:.1f} |")
            else:
                counted = theirs["peak_bytes"]
                lines.append(f"| {method} | {name} | {mine['peak_bytes'] / MIB:.2f} | {counted / MIB:.2f} | "
                             f"{mine['peak_bytes'] / counted:.3f} |")
    if args.run:
        lines += ["", *train_run(args.run, overrides, gpu)]
    setting = f"Overrides: {' '.join(overrides) or 'none'}."
    if gpu:
        head = page_header("The memory planner against CUDA", machine("cuda"), "Plan on meta (target cuda) against "
                           "CUDA's peaks; an evaluation's reserved figure includes the blocks training left cached, as "
                           f"in a run. {setting}", started)
    else:
        head = ("No CUDA device here: nothing to compare with torch.cuda.max_memory_allocated/reserved. Comparing the "
                "meta plan with the same steps on real CPU tensors (exact bytes) instead.\n\n"
                f"{provenance(machine(), setting, started)}\n\n")
    write_markdown(args.out, head + "\n".join(lines) + "\n")


def train_run(method: str, overrides: list[str], gpu: bool) -> list[str]:
    """A table of one row: a `dpmem train` run of `method` beside its plan (as `dpmem memory` plans it)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=[f"method={method}", *overrides, "train.steps=4", "train.static_shapes=true",
                                           "logging.progress=false", f"train.device={'cuda' if gpu else 'cpu'}"]
                      + ([] if gpu else ["memory.target=cpu"]))
    cfg.train.physical_batch_size = max(1, cfg.train.batch_size // 2)
    planned = plan(cfg, device="meta")
    if gpu:
        gc.collect()
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as folder:
        summary = run_training(cfg, Path(folder))
    if summary["status"] != "ok":
        return [f"The `dpmem train` run of {method} ended {summary['status']}: {summary.get('error')}"]
    mine = planned["peak_bytes"] if gpu else planned["training"]["peak_bytes"]
    theirs = summary["peak_memory_allocated_bytes"] if gpu else summary["peak_memory_bytes"]
    what = "training and evaluation, allocated" if gpu else "training, live tensors"
    return ["| run | physical B | plan MiB | measured MiB | plan ÷ measured |", "|---|---|---|---|---|",
            f"| dpmem train method={method} ({what}) | {cfg.train.physical_batch_size} | {mine / MIB:.1f} | "
            f"{theirs / MIB:.1f} | {mine / theirs:.3f} |"]


if __name__ == "__main__":
    main()
