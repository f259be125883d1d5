"""Every pending GPU figure from one command, within a time budget: the GPU machine is at hand now and then, for
minutes, so what it must show runs in one call.

    python scripts/gpu_figures.py                          # on a GPU machine: --budget 480 (seconds)
    python scripts/gpu_figures.py --device cpu --tiny      # the whole sequence at toy sizes (the tests run it),
                                                           # each step forked from this process (warm_start.py)

In order of value, one at a time, each step a process of its own (a crash or an out-of-memory ends that step only):

    tests          pytest -m cuda (CUDA graphs over micro-batches, every method in fp32/tf32/bf16, resume, plans)
    compile-tf32   scripts/bench_compile.py --device cuda --shapes roberta-base --precision tf32
    compile-bf16   the same in bf16 (autocast)
    memory         scripts/validate_memory.py: roberta-large mlm, B = 40, adam / dp-adam / grape with and without
                   checkpointing, and one `dpmem train` run's peak (training and evaluation) against its plan
    plan           scripts/bench_plan.py --measure cuda: the plan's estimated samples/s against measured
    peers-tf32     scripts/bench_peers.py --device cuda --precision tf32 (B = 32)
    peers-bf16     the same in bf16

A step whose estimated time (seconds on an H200) exceeds what is left of the budget is skipped, and the summary says
so; a step that runs past 1.5 times its estimate, or past the budget, is stopped, so that the steps after it keep
their time. Each script writes its own page (under --pages,
default docs/benchmarks/) as soon as it has measured; this script then rewrites the summary page (gpu.md there:
each figure beside its target, the GPU, torch, commit and date) and, with --archive, packs every page written so
far into one tar file, so that a call cut short still brings back what was done. A tree copied without its git
folder names its commit through the environment variable DPMEM_COMMIT.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import warm_start

ROOT = Path(__file__).resolve().parents[1]
NEEDED = {"dpmem": "dpmem (pip install -e . or PYTHONPATH=the checkout)", "opacus": "opacus",
          "dp_accounting": "dp-accounting", "hydra": "hydra-core", "pytest": "pytest", "xdist": "pytest-xdist"}
MEMORY = ["model=roberta-large", "data=synthetic", "train.batch_size=40"]
TINY_MEMORY = ["model=roberta-tiny", "data=synthetic", "data.seq_len=16", "train.batch_size=4"]


@dataclass
class Step:
    name: str
    what: str
    gpu: list[str]   # arguments on a GPU (after the interpreter)
    tiny: list[str]  # the same at toy sizes on the CPU
    estimate: float  # seconds on an H200 (2026-11-27), its compiles from a fresh cache
    page: str = ""   # the page it writes under --pages ("" for the tests, whose result is the summary's)
    status: str = "not run"
    seconds: float = 0.0
    figures: list[tuple[str, str, str]] = field(default_factory=list)  # (figure, measured, target)


def steps() -> list[Step]:
    pytest = ["-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "--dist", "loadgroup", "-o",
              "console_output_style=classic"]
    compile_args = ["scripts/bench_compile.py", "--steps", "5"]
    tiny_compile = ["scripts/bench_compile.py", "--device", "cpu", "--shapes", "tiny", "--steps", "1", "--backend",
                    "eager", "--warm-cache"]
    peers = ["scripts/bench_peers.py", "--device", "cuda", "--batch-sizes", "32", "--steps", "5"]
    tiny_peers = ["scripts/bench_peers.py", "--device", "cpu", "--model", "roberta-tiny", "--batch-sizes", "2",
                  "--seq-len", "8", "--steps", "1"]
    return [
        Step("tests", "pytest -m cuda", [*pytest, "-n", "8"],
             [*pytest, "-n", "0", "tests/test_cuda.py", "tests/test_randomness.py"], 60),
        Step("compile-tf32", "compiled step, roberta-base B 32 T 128, TF32",
             [*compile_args, "--device", "cuda", "--shapes", "roberta-base", "--precision", "tf32"],
             # at toy sizes one compiled dpmem method: the page and its figures are the same code for grape's
             [*tiny_compile, "--precision", "fp32", "--contestants", "torch AdamW (non-private)",
              "torch AdamW (non-private), compiled", "Opacus hooks", "dpmem dp-adam (bk), compiled"], 200,
             "compile-cuda-tf32.md"),
        Step("compile-bf16", "compiled step, roberta-base B 32 T 128, bf16",
             [*compile_args, "--device", "cuda", "--shapes", "roberta-base", "--precision", "bf16"],
             [*tiny_compile, "--precision", "bf16", "--contestants", "torch AdamW (non-private)",
              "dpmem dp-adam (bk), compiled"], 200, "compile-cuda-bf16.md"),
        Step("memory", "planner against CUDA, roberta-large mlm B 40, and a dpmem train run",
             ["scripts/validate_memory.py", "--methods", "adam", "dp-adam", "grape", "--run", "grape", *MEMORY],
             ["scripts/validate_memory.py", "--methods", "grape", "--run", "grape", *TINY_MEMORY], 75,
             "validate-memory-cuda.md"),
        Step("plan", "plan estimate against measured, roberta-large",
             ["scripts/bench_plan.py", "--settings", "--check", "gpu-roberta-large", "--measure", "cuda",
              "--plan-device", "h100", "--steps", "3", "--top", "3"],
             # at toy sizes also the tiny plan shown whole, and two configurations measured: tests/test_scripts.py
             # reads this page for bench_plan.py's own smoke test, which then needs no run of its own
             ["scripts/bench_plan.py", "--settings", "tiny", "--check", "tiny", "--measure", "cpu", "--steps", "1",
              "--top", "2"], 100, "plan-cuda.md"),
        Step("peers-tf32", "peers, roberta-base B 32 T 128, TF32", [*peers, "--precision", "tf32"],
             [*tiny_peers, "--precision", "fp32", "--contestants", "torch AdamW (non-private)", "Opacus hooks",
              "dpmem dp-adam (bk)"], 45, "peers-cuda-tf32.md"),
        Step("peers-bf16", "peers, roberta-base B 32 T 128, bf16", [*peers, "--precision", "bf16"],
             [*tiny_peers, "--precision", "bf16", "--contestants", "torch AdamW (non-private)",
              "dpmem dp-adam (bk)"], 45, "peers-cuda-bf16.md"),
    ]


# -- what each page's figures are, beside their targets ------------------------------------------------------------

def tables(text: str) -> list[dict[str, str]]:
    """Every row of every markdown table in `text`, as {column: cell} (dpmem.report.pages: a column named as one
    before it is "NAME 2", as the peers' page's second "× AdamW", its memory)."""
    from dpmem.report.pages import tables as page_tables  # dpmem imported late: a missing package is said first

    return [row for table in page_tables(text) for row in table.rows]


def number(cell: str | None) -> float | None:
    match = re.match(r"-?[0-9.]+(e[-+]?[0-9]+)?", cell or "")
    return float(match.group()) if match else None


def ratio_range(values: list[float]) -> str:
    return f"{min(values):.3f}–{max(values):.3f}" if values else "none measured"


def compile_figures(text: str) -> list[tuple[str, str, str]]:
    rows = {r["contestant"]: r for r in tables(text) if "contestant" in r}
    out = []
    for name, target in (("dpmem dp-adam (bk), compiled", "≥ 0.90× compiled AdamW"),
                         ("dpmem grape, compiled", "≥ 1.0× compiled AdamW")):
        if name in rows:
            r = rows[name]
            out.append((name, f"{r['× AdamW compiled']}× compiled AdamW, {r['× AdamW eager']}× eager; peak "
                              f"{r['peak (MiB)']} MiB; compile {r['compile (s)']} s", target))
    if "Opacus hooks" in rows and "dpmem dp-adam (bk), compiled" in rows:
        mine, theirs = (number(rows[n]["samples/s"]) for n in ("dpmem dp-adam (bk), compiled", "Opacus hooks"))
        out.append(("compiled dp-adam ÷ Opacus hooks", f"{mine / theirs:.2f}×", "> 1"))
    return out


def memory_figures(text: str) -> list[tuple[str, str, str]]:
    rows = tables(text)
    key = next((k for k in ("plan / allocated", "meta / CPU") if rows and k in rows[0]), None)
    out = []
    for part in ("training", "evaluation"):
        values = [number(r[key]) for r in rows if key and key in r and r["part"].startswith(part)]
        out.append((f"plan ÷ measured, {part} ({len(values)} rows)", ratio_range([v for v in values if v]),
                    "0.90–1.10"))
    run = [r for r in rows if "run" in r]
    for r in run:
        out.append((f"{r['run']}: plan ÷ measured peak", r["plan ÷ measured"], "0.90–1.10"))
    return out


def plan_figures(text: str) -> list[tuple[str, str, str]]:
    rows = [r for r in tables(text) if "estimate ÷ measured" in r]
    ratios = [number(r["estimate ÷ measured"]) for r in rows]
    best = re.search(r"The measured best is the plan's #(\d+)", text)
    return [("estimate ÷ measured, top configurations", ratio_range([r for r in ratios if r]), "within 0.5–2"),
            ("rank of the measured best in the plan", f"#{best.group(1)}" if best else "?", "#1 or #2")]


def peers_figures(text: str) -> list[tuple[str, str, str]]:
    out = []
    for r in tables(text):
        if r.get("contestant", "").startswith(("dpmem", "Opacus")):
            out.append((f"{r['contestant']}, B {r['B']}", f"{r['× AdamW']}× AdamW speed, {r['× AdamW 2']}× memory",
                        "dpmem ≥ Opacus hooks"))
    return out


FIGURES = {"compile": compile_figures, "memory": memory_figures, "plan": plan_figures, "peers": peers_figures}


def test_figures(output: str) -> list[tuple[str, str, str]]:
    closing = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)", line)]
    counts = re.findall(r"(\d+) (passed|failed|skipped|errors?)", closing[-1] if closing else "")
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in output.splitlines() if line.startswith("FAILED ")]
    out = [("pytest -m cuda", ", ".join(f"{n} {what}" for n, what in counts) or "no result line", "0 failed")]
    out += [("failed", name, "") for name in failed[:12]]
    return out


# -- running ----------------------------------------------------------------------------------------------------------

def missing() -> list[str]:
    return [name for module, name in NEEDED.items() if importlib.util.find_spec(module) is None]


def summary_page(args, started: float, plan: list[Step], device_name: str) -> str:
    sys.path.insert(0, str(ROOT))
    from dpmem.report import page_header

    lines = ["| step | status | seconds | page |", "|---|---|---|---|"]
    for s in plan:
        link = f"[{s.page}]({s.page})" if s.page and s.status.startswith("done") else "-"
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.0f} | {link} |")
    lines += ["", "| step | figure | measured | target |", "|---|---|---|---|"]
    for s in plan:
        lines += [f"| {s.name} | {f} | {m} | {t} |" for f, m, t in s.figures]
    header = page_header("Every pending GPU figure (scripts/gpu_figures.py)", device_name,
                         f"Budget {args.budget:.0f} s; each step's own page has its command and settings.", started)
    return header + "\n".join(lines) + "\n"


def device_name(device: str) -> str:
    import torch
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    sys.path.insert(0, str(ROOT))
    from dpmem.report import machine
    return machine("cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=480, help="seconds for the whole sequence")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (with --device cpu: the tests' check)")
    ap.add_argument("--only", nargs="+", default=None, choices=[s.name for s in steps()],
                    help="these steps, in this order (default: all, in order of value)")
    ap.add_argument("--pages", default=None, help="folder of the pages (default: docs/benchmarks; --tiny: a "
                                                   "temporary folder)")
    ap.add_argument("--archive", default=None, help="after each step, every page so far packed into this tar file")
    args = ap.parse_args()
    started = time.time()
    if lacking := missing():
        raise SystemExit(f"gpu_figures: missing {', '.join(lacking)}: on an offline machine, install them from "
                         "wheels downloaded elsewhere (pip download; pip install --no-index --find-links DIR)")
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_figures: --device cuda: no CUDA device is available here (--device cpu --tiny checks "
                         "the sequence on the CPU)")
    if args.device == "cpu" and not args.tiny:
        raise SystemExit("gpu_figures: --device cpu measures nothing pending; use it with --tiny")
    pages = Path(args.pages or (tempfile.mkdtemp(prefix="dpmem-gpu-figures-") if args.tiny
                                else ROOT / "docs" / "benchmarks"))
    pages.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="dpmem-gpu-logs-"))  # each step's output, in the archive
    plan = steps() if args.only is None else [next(s for s in steps() if s.name == n) for n in args.only]
    name = device_name(args.device)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           **({"OMP_NUM_THREADS": "1"} if args.tiny else {})}  # a toy step on one core (the tests' other on the other)

    def saved(s: Step, output: str) -> None:
        """The step's log and figures, then the summary page and the archive, as soon as the step is done."""
        (logs / f"gpu-{s.name}.log").write_text(output)
        if s.name == "tests":
            s.figures = test_figures(output.strip())
        elif s.page and (pages / s.page).exists() and s.status == "done":
            s.figures = FIGURES[s.name.split("-")[0]]((pages / s.page).read_text())
        if not s.status.startswith("done"):
            s.figures.append(("why", (output.strip().splitlines() or ["no output"])[-1][:200], ""))
        print(f"gpu_figures: {s.name} {s.status} in {s.seconds:.0f} s", flush=True)
        (pages / "gpu.md").write_text(summary_page(args, started, plan, name))
        if args.archive:
            written = [pages / "gpu.md", *(pages / t.page for t in plan if t.page and t.status == "done"),
                       *sorted(logs.iterdir())]
            with tarfile.open(args.archive, "w:gz") as tar:
                for path in written:
                    if path.exists():
                        tar.add(path, arcname=path.name)

    deadline = time.monotonic() + args.budget

    def attempt(s: Step) -> None:
        """The step, unless its estimate exceeds what is left of the budget; stopped at 1.5 times its estimate."""
        left = deadline - time.monotonic()
        estimate = 0 if args.tiny else s.estimate
        if estimate > left or left <= 0:
            s.status = f"skipped: needs about {estimate:.0f} s, {max(left, 0):.0f} s left"
            print(f"gpu_figures: {s.name} {s.status}", flush=True)
            return
        limit = max(1, left if args.tiny else min(left, 1.5 * s.estimate))
        argv = [sys.executable, *(s.tiny if args.tiny else s.gpu)] + (["--out", str(pages / s.page)] if s.page else [])
        print(f"gpu_figures: {s.name}: {' '.join(argv[1:])}", flush=True)
        tic = time.monotonic()
        # a session of its own: a step stopped at its limit takes its children (test workers, compile workers,
        # `dpmem plan`) with it, and they free the GPU for the next
        proc = warm_start.start(argv, ROOT, env, fork=warm)
        try:
            output, _ = proc.communicate(timeout=limit)
            code = proc.returncode
            s.status = "done" if code == 0 or (s.name == "tests" and code == 1) else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            s.status = f"stopped after {limit:.0f} s"
        s.seconds = time.monotonic() - tic
        saved(s, output)

    # one step at a time, in order of value: on a GPU each has the device to itself; at toy sizes on the CPU a
    # step's time was its imports, which each step's process inherits, forked from this one (warm_start; not where a
    # GPU is attached)
    warm = args.tiny and args.budget > 0 and warm_start.available()  # preloaded only if a step runs
    if warm:
        warm_start.preload()
    for s in plan:
        attempt(s)
    text = summary_page(args, started, plan, name)
    (pages / "gpu.md").write_text(text)
    print(f"\n{text}\nPages in {pages}; each step's output in {logs}.")


if __name__ == "__main__":
    main()
