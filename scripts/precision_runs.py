"""One short `dpmem train` run of every method in every precision, as a markdown table: did it train, its loss,
throughput and peak memory. What a user who switches `train.precision` sees, side by side in one process.

    python scripts/precision_runs.py                                   # roberta-base shape, synthetic tokens
    python scripts/precision_runs.py model=roberta-tiny train.steps=3 --precisions fp32 bf16   # on the CPU

Trailing key=value arguments are dpmem overrides (after the defaults below). The coverage check is on, as in a
user's run. Writes docs/benchmarks/precision.md (its page, headed by the command, device, torch version and date;
`--out` writes elsewhere) and prints it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from dpmem.composition import CONF_DIR
from dpmem.engine.trainer import run_training
from dpmem.report import benchmark_page, machine, page_header, write_markdown

DEFAULTS = ["model=roberta-base", "data=synthetic", "data.seq_len=128", "train.batch_size=32", "train.steps=12",
            "logging.progress=false", "logging.every=4", "privacy.epsilon=8"]
METHODS = {"adam": ["method=adam", "privacy=none"], "dp-adam (bk)": ["method=dp-adam"],
           "dp-adam ghost": ["method=dp-adam", "method.clipping=ghost"],
           "dp-adam materialize": ["method=dp-adam", "method.clipping=materialize"],
           "grape": ["method=grape"], "dp-sgd-rc (bk)": ["method=dp-sgd-rc", "method.bookkeeping=true"],
           "galore-dp-naive": ["method=galore-dp-naive"], "dpzero": ["method=dpzero", "train.lr=1e-5"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "tf32", "bf16"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--out", default=benchmark_page(__file__, "precision"),
                    help="the page to write (default: docs/benchmarks/precision.md)")
    args, overrides = ap.parse_known_args()
    started = time.time()
    lines = ["| method | precision | status | first → last loss | samples/s | peak allocated MiB |",
             "|---|---|---|---|---|---|"]
    for name in args.methods:
        for precision in args.precisions:
            with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
                cfg = compose("config", overrides=[*DEFAULTS, *METHODS[name], f"train.precision={precision}",
                                                   *overrides])
            with tempfile.TemporaryDirectory() as folder:
                try:
                    s = run_training(cfg, Path(folder))
                except Exception as e:  # noqa: BLE001  (the table says what failed)
                    lines.append(f"| {name} | {precision} | {type(e).__name__}: {str(e).splitlines()[0][:90]} "
                                 "| | | |")
                    continue
                losses = [r["loss"] for r in map(json.loads, (Path(folder) / "metrics.jsonl").read_text()
                                                 .splitlines()) if "loss" in r]
            peak = s.get("peak_memory_allocated_bytes") or s["peak_memory_bytes"]
            lines.append(f"| {name} | {precision} | {s['status']} | {losses[0]:.3f} → {losses[-1]:.3f} | "
                         f"{s['throughput_samples_per_s']:.0f} | {peak / 2**20:.0f} |")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    details = (f"Overrides: {' '.join(DEFAULTS + overrides)}. Samples/s include the first steps' warm-up: they say "
               "that a run goes, not how fast.")
    header = page_header("Every method in every precision", machine("cuda" if torch.cuda.is_available() else "cpu"),
                         details, started)
    write_markdown(args.out, header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
