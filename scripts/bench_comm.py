"""Bytes all-reduced per training step when one run is data-parallel over 2 processes (torchrun, gloo), per method,
as a markdown table: DP-GRAPE sums its r-dimensional projected clipped gradients across ranks, DP-Adam the full
m×n ones.

    python scripts/bench_comm.py                                  # roberta-base and roberta-large, 1 step each
    python scripts/bench_comm.py --models roberta-base --methods dp-adam grape

It starts itself under torchrun (2 CPU processes); every rank runs one step of a dpmem `Run` on synthetic
SST-2-shaped data, and rank 0 reads dpmem.distributed.Traffic, which counts the payload of every all-reduce.
The "expected" column is the sum of the trainable parameters' sizes (projected ones at their projected shape).
The table lands in docs/benchmarks/comm.md (its page, headed by the command, device, torch version and date; `--out`
writes elsewhere) and is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

METHODS = {"adam": [], "dp-adam": [], "grape": [], "grape, embeddings projected": ["method.project_embeddings=true"]}


def expected_bytes(run) -> tuple[int, float | None]:
    """What the method's all-reduce should carry (its gradient's, or projected gradient's, elements at 4 bytes),
    and for grape the full over the projected size of its projected matrices alone (m/r when all are m×n)."""
    method = run.method
    sides = getattr(method, "sides", {})  # grape: the projected parameters; their projected shapes follow
    size = {p: torch.Size(method.shapes[p]).numel() if sides else p.numel() for p in method.params}
    ratio = sum(p.numel() for p in sides) / sum(size[p] for p in sides) if sides else None
    return 4 * sum(size.values()), ratio


def worker(args) -> None:
    from dpmem import distributed
    from dpmem.composition import CONF_DIR
    from dpmem.engine.trainer import Run

    distributed.init_from_env()
    rows = []
    for model in args.models:
        for label in args.methods:
            name = label.split(",")[0]
            overrides = [f"model={model}", "data=synthetic", "data.seq_len=32", "data.num_classes=2",
                         f"method={name}", *METHODS[label], "train.steps=1", "train.batch_size=2",
                         "privacy=eps8", "privacy.noise_seed=0", "privacy.sampler_seed=0", "logging.progress=false", "logging.memory_steps=0"]
            with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
                cfg = compose("config", overrides=overrides)
            with tempfile.TemporaryDirectory() as folder:
                run = Run(cfg, Path(folder))
                run.prepare()
                before = distributed.Traffic.bytes
                summary = run.execute()
                sent = distributed.Traffic.bytes - before - 4  # less the logged loss
                if summary["status"] != "ok":
                    raise RuntimeError(summary["error"])
            expected, ratio = expected_bytes(run)
            rows.append({"model": model, "method": label, "bytes": sent, "expected": expected,
                         "projected_ratio": ratio})
            del run
    if distributed.is_main():
        print("ROWS " + json.dumps(rows), flush=True)
    distributed.close()


def table(rows: list[dict]) -> str:
    lines = ["| model | method | MiB all-reduced per step | expected (MiB) | dp-adam's ÷ this | on the projected "
             "matrices alone |", "|---|---|---|---|---|---|"]
    for r in rows:
        base = next(x["bytes"] for x in rows if x["model"] == r["model"] and x["method"] == "dp-adam")
        alone = f"{r['projected_ratio']:.1f}" if r["projected_ratio"] else ""
        lines.append(f"| {r['model']} | {r['method']} | {r['bytes'] / 2**20:.1f} | {r['expected'] / 2**20:.1f} | "
                     f"{base / r['bytes']:.1f} | {alone} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["roberta-base", "roberta-large"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", default=None, help="the page to write (default: docs/benchmarks/comm.md)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from dpmem.report import benchmark_page, machine, page_header, write_markdown

    started = time.time()
    if "dp-adam" not in args.methods:
        args.methods = ["dp-adam", *args.methods]  # the ratios' base
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           __file__, "--worker", "--models", *args.models, "--methods", *args.methods],
                          env=env, capture_output=True, text=True)
    found = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
    if done.returncode != 0 or not found:
        sys.exit(done.stdout[-3000:] + done.stderr[-3000:])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # a rank per GPU where there are two
    where = (f"2 ranks, one {torch.cuda.get_device_name(0)} each (NCCL)" if gpus >= 2
             else f"2 processes (gloo) on a {machine(threads=1)} each")
    details = ("One step of each method on synthetic SST-2-shaped data (T = 32, B = 2), under torchrun; every "
               "all-reduce's payload counted by dpmem.distributed.Traffic, less the logged loss. \"expected\": the "
               "trainable parameters' size at 4 bytes, projected ones at their projected shape.")
    header = page_header("Bytes all-reduced per step", where, details, started)
    write_markdown(args.out or benchmark_page(__file__, "comm"), header + table(json.loads(found[0][5:])))


if __name__ == "__main__":
    main()
