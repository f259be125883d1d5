"""`dpmem plan` on the settings its docs page shows, and its estimates against measurements, as a markdown page.

    python scripts/bench_plan.py                  # the plans; the estimate against a CPU measurement
    python scripts/bench_plan.py --measure cuda --plan-device h100 --check roberta-large opt-1.3b --settings
                                                  # on a GPU: the top five configurations of each, measured
    python scripts/bench_plan.py --measure cuda --check gpu-roberta-large --settings --top 3    # gpu_figures' check

Plans: roberta-large (T = 128, logical batch 1024 of 60,000 synthetic examples) on a 24 GB L4, and OPT-6.7B
(T = 512, logical batch 256) on an 80 GB H100, each `dpmem plan` timed whole (the issue asks under two minutes on 2
cores for the OPT one).

Estimate against measurement: the plan of `--check` on `--plan-device` (cpu: this host, measured), then its top
five configurations built with weights on `--measure`, each timed over `--steps` steps after a warm-up step, one
at a time in this process; the table gives estimate ÷ measurement and where the measured best ranks in the plan.
A setting shown whole and checked on the device it names is planned once, for both sections.
The page lands in docs/benchmarks/plan.md (`--out` writes elsewhere)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dpmem.composition import compose_points
from dpmem.data import build_data, example_batch
from dpmem.engine.assemble import assemble
from dpmem.precision import RunPrecision
from dpmem.report import benchmark_page, machine, page_header, write_markdown

SETTINGS = {
    "roberta-large": ["model=roberta-large", "data=synthetic", "data.seq_len=128", "data.n_train=60000",
                      "train.batch_size=1024", "privacy=eps6", "plan.device=l4", "memory.budget=24GB"],
    "opt-6.7b": ["model=opt-6.7b", "data=synthetic", "data.seq_len=512", "train.batch_size=256", "privacy=eps6",
                 "plan.device=h100", "memory.budget=80GB"],
    "opt-1.3b": ["model=opt-1.3b", "data=synthetic", "data.seq_len=256", "train.batch_size=256", "privacy=eps6",
                 "plan.device=h100", "memory.budget=80GB"],
    # scripts/gpu_figures.py's: roberta-large (T = 128) at a logical batch a GPU steps through in about a second,
    # four first-order candidates in TF32 without checkpointing, so that the plan takes about a minute
    "gpu-roberta-large": ["model=roberta-large", "data=synthetic", "data.seq_len=128", "data.n_train=6000",
                          "train.batch_size=128", "privacy=eps6", "memory.budget=80GB", "plan.precisions=[tf32]",
                          "plan.checkpointing=[false]", 'plan.candidates=["method=dp-adam method.clipping=bk",'
                          '"method=dp-adam method.clipping=ghost","method=grape","method=adam privacy=none"]'],
    # the test suite's: two candidates on a tiny RoBERTa (tests/test_scripts.py), planned on the cpu as its check on
    # the cpu is, so that one `dpmem plan` serves both sections
    "tiny": ["model=roberta-tiny", "data=synthetic", "data.seq_len=16", "train.batch_size=16", "privacy=eps6",
             "memory.budget=64MiB", 'plan.candidates=["method=dp-adam","method=grape"]', "plan.checkpointing=[false]",
             "plan.device=cpu"],
    # a CPU-sized RoBERTa (4 blocks of width 256, T = 64): the estimate checked where it can be measured here
    "cpu-roberta": ["model=roberta-tiny", "model.arch.hidden_size=256", "model.arch.num_hidden_layers=4",
                    "model.arch.intermediate_size=1024", "model.arch.num_attention_heads=4", "data=synthetic",
                    "data.seq_len=64", "train.batch_size=64", "privacy=eps6", "memory.budget=256MiB"],
}


def run_plan(overrides: list[str], folder: Path) -> tuple[dict, str, float]:
    """`dpmem plan` in a process of its own, as a user runs it: its plan.json, plan.md and wall seconds."""
    tic = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "dpmem", "plan", *overrides, f"plan.dir={folder}"],
                         capture_output=True, text=True)
    wall = time.perf_counter() - tic
    if out.returncode:
        raise SystemExit(f"dpmem plan failed: {out.stderr.strip().splitlines()[-1]}")
    return json.loads((folder / "plan.json").read_text()), (folder / "plan.md").read_text(), wall


def measure(overrides: list[str], device: torch.device, steps: int) -> float:
    """Samples/s of one configuration's step (median over `steps` after a warm-up), with weights, on `device`."""
    cfg = compose_points([[*overrides, f"train.device={device.type}"]])[0]
    t = cfg.train
    torch.manual_seed(t.seed)
    data = build_data(cfg.data, cfg.model)
    parts = assemble(cfg, device, data)  # private methods: a stand-in noise of σ = 1 (σ changes no time)
    physical = t.physical_batch_size or t.batch_size
    sizes = [physical] * (t.batch_size // physical) + ([t.batch_size % physical] if t.batch_size % physical else [])
    micro = [example_batch(data, size, device) for size in sizes]
    precision = RunPrecision(t.precision, device)
    loss_fn = precision.forward(parts.per_sample_loss)
    times = []
    with precision:
        for i in range(steps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            tic = time.perf_counter()
            parts.method.step(micro, loss_fn)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first step makes the state and runs the one-off checks
                times.append(time.perf_counter() - tic)
    parts.method.close()
    return t.batch_size / statistics.median(times)


def check(name: str, plan: dict, device: torch.device, steps: int, top: int) -> str:
    rows = [r for r in plan["rows"] if r["fits"]][:top]
    measured = []
    for r in rows:
        measured.append(measure([*SETTINGS[name], *r["overrides"], f"train.precision={r['precision']}",
                                 f"train.physical_batch_size={r['physical_batch_size']}"], device, steps))
        print(f"{r['configuration']}: estimated {r['samples_per_s']:.3g}, measured {measured[-1]:.3g} samples/s",
              file=sys.stderr)
    best = max(range(len(rows)), key=lambda i: measured[i])
    lines = [f"### {name}: the plan's top {len(rows)}, measured on {machine(device)}", "",
             "| plan rank | configuration | physical B | est. samples/s | measured samples/s | estimate ÷ measured |",
             "|---|---|---|---|---|---|"]
    for i, (r, m) in enumerate(zip(rows, measured), 1):
        lines.append(f"| {i} | {r['configuration']} {r['precision']} | {r['physical_batch_size']} | "
                     f"{r['samples_per_s']:.3g} | {m:.3g} | {r['samples_per_s'] / m:.2f} |")
    ratios = [r["samples_per_s"] / m for r, m in zip(rows, measured)]
    lines += ["", f"The measured best is the plan's #{best + 1}; estimate ÷ measured from {min(ratios):.2f} to "
              f"{max(ratios):.2f}."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="*", default=["roberta-large", "opt-6.7b"], choices=sorted(SETTINGS),
                    help="the plans shown whole")
    ap.add_argument("--check", nargs="*", default=["cpu-roberta"], choices=sorted(SETTINGS),
                    help="the settings whose top configurations are measured")
    ap.add_argument("--measure", default="cpu", help="the device the check measures on (cpu, cuda)")
    ap.add_argument("--plan-device", default=None, help="plan.device of the check (default: cpu on the cpu)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per measured configuration")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--out", default=benchmark_page(__file__, "plan"))
    args = ap.parse_args()
    started = time.time()
    device = torch.device(args.measure)
    sections, plans = [], {}

    def planned(overrides: list[str], folder: Path) -> tuple[dict, str, float]:
        """run_plan, once for the same overrides."""
        if tuple(overrides) not in plans:
            plans[tuple(overrides)] = run_plan(overrides, folder)
        return plans[tuple(overrides)]

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.settings:
            plan, text, wall = planned(SETTINGS[name], Path(tmp) / name)
            body = text.split("\n", 2)[2]  # below the plan's own title
            sections.append(f"## {name}\n\n`dpmem plan {' '.join(SETTINGS[name])}` took {wall:.0f} s.\n\n{body}")
        for name in args.check:
            plan_device = args.plan_device or ("cpu" if device.type == "cpu" else "h100")
            # the setting's own plan.device, if it names one, replaced in place (as Hydra's last value would be)
            overrides = list({o.split("=", 1)[0]: o for o in [*SETTINGS[name], f"plan.device={plan_device}"]}.values())
            plan, _, wall = planned(overrides, Path(tmp) / f"check-{name}")
            sections.append(f"## Estimate against measurement\n\n`dpmem plan {' '.join(overrides)}` took {wall:.0f} "
                            f"s; device table: {plan['device']['source']}.\n\n"
                            + check(name, plan, device, args.steps, args.top))
    text = page_header("dpmem plan: chosen configurations, and estimates against measurements", machine(device),
                       "plans on the meta device; times are roofline estimates unless measured", started)
    write_markdown(args.out, text + "\n\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
