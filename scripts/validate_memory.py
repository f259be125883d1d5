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
"""

from __future__ import annotations

import argparse
import gc
import math
import time

import torch
from hydra import compose, initialize_config_dir

from dpmem.cli import CONF_DIR
from dpmem.engine.planner import plan
from dpmem.report import benchmark_page, machine, page_header, provenance, write_markdown
from dpmem.report.memory import evaluated

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["adam", "dp-adam", "grape", "galore-dp-naive", "dp-sgd-rc",
                                                     "dpzero"])
    ap.add_argument("--checkpointing", choices=["off", "on", "both"], default="both",
                    help="train.activation_checkpointing for each method: off, on, or a row of each")
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


if __name__ == "__main__":
    main()
