"""The tutorial page, docs/tutorial.md, and its figures, docs/tutorial/*.png: one task from its data to a private
fine-tune, its ε and its accuracy against ε, then peak memory by method, written from the very commands the page
shows, each run as a reader runs it (`python -m dpmem ...`, the `dpmem` entry point), in a process of its own: on a
machine without a GPU forked from this one once torch, transformers and dpmem are imported (warm_start.py), which
were most of a toy run's time.

    python scripts/tutorial.py                          # docs/tutorial.md and docs/tutorial/ (18 trainings of the
                                                        # default length, about 20 s each on 2 idle cores)
    python scripts/tutorial.py --tiny --out /tmp/t      # every command at toy size (3 steps, 2 ε, 1 seed, a tiny
                                                        # model planned): the test's (tests/test_tutorial.py)

The commands run in a work folder (--work, default a temporary one, deleted at the end) and name their run folders
relative to it (outputs/tutorial/...), so the page shows no path of this machine. Each command is printed as it
starts and, once all have run, written to OUT/tutorial/commands.txt in the page's order: the page's `bash` blocks
are those lines. Outputs are quoted as printed, less the lines that time a run (throughput, wall time): the page is
regenerated on machines that run other jobs. The header names the command, the commit (DPMEM_COMMIT first) and the
date.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import warm_start
from dpmem.report import GIB, machine, markdown_table, provenance, pyplot, save_figure, write_markdown

ROOT = Path(__file__).resolve().parents[1]
RUNS = "outputs/tutorial"  # the run folders, relative to the folder the commands run in
UNTIMED = ("throughput", "wall time")  # closing-table lines left off the page
PARTS = ("parameters", "gradients", "per_sample", "optimizer_state", "noise_buffers", "activations", "temporaries")
# what each planned method keeps, in words (the memory table's second column)
KEEPS = {
    "method=adam": "non-private: weights, gradients, Adam's two moments",
    "method=dp-adam": "per-sample clipping by book-keeping (bk, the default): per-sample norms, no B per-sample "
                      "gradients",
    "method=dp-adam-materialize": "dp-adam with `method.clipping=materialize`: B per-sample gradients, as Opacus",
    "method=grape": "per-sample gradients projected to rank 16; Adam's moments in the projected space",
    "method=galore-dp-naive": "privatised as dp-adam (materialised), then GaLore's rank-r Adam state",
    "method=dpzero": "zeroth order: forward passes only, no gradients",
}


class Sizes:
    """The overrides of a setting: the full page's, or the test's toy one."""

    def __init__(self, tiny: bool):
        self.tiny = tiny
        self.train = ("train.steps=3",) if tiny else ()  # the full page: the default length (60 epochs, 337 steps)
        self.epsilons = ("eps2", "eps8") if tiny else ("eps1", "eps2", "eps4", "eps8")
        self.seeds = ("0",) if tiny else ("0", "1")
        self.memory = (("model=roberta-tiny", "data=synthetic", "data.seq_len=16", "train.batch_size=8") if tiny else
                       ("model=roberta-base", "data=synthetic", "data.seq_len=128", "data.num_classes=2",
                        "train.batch_size=32"))
        self.methods = tuple(KEEPS)


def commands(s: Sizes) -> dict[str, tuple[str, ...]]:
    """Each step's `dpmem` arguments, in the page's order."""
    sweep = (f"{RUNS}/sweep", f"{RUNS}/adam")
    return {
        "run": ("train", "method=dp-adam", "privacy=eps8", *s.train, f"hydra.run.dir={RUNS}/dp-adam-eps8"),
        "sweep": ("train", "-m", "method=dp-adam,grape", f"privacy={','.join(s.epsilons)}",
                  f"train.seed={','.join(s.seeds)}", *s.train, f"hydra.sweep.dir={sweep[0]}"),
        "baseline": ("train", "method=adam", "privacy=none", *s.train, f"hydra.run.dir={sweep[1]}"),
        "report": ("report", *sweep),
        "memory": ("memory", *s.memory, "method=" + ",".join(m.split("=")[1] for m in s.methods),
                   f"memory.dir={RUNS}/memory"),
    }


def shown(args: tuple[str, ...]) -> str:
    """A command as the page shows it (and as a shell reads it)."""
    return " ".join(["dpmem", *map(shlex.quote, args)])


def run(args: tuple[str, ...], work: Path) -> str:
    """`python -m dpmem ARGS` in `work`, as a reader runs it, in a process of its own (forked from this one where
    warm_start allows): its stdout (the run stops at the first failure)."""
    with warm_start.LOCK:
        print(f"$ {shown(args)}", flush=True)
    # in this process's session: a Ctrl-C here stops the command too
    child = warm_start.start([sys.executable, "-m", "dpmem", *args], work, dict(os.environ), merged=False,
                             new_session=False)
    stdout, stderr = child.communicate()
    if child.returncode:
        tail = "\n".join((stderr or stdout).strip().splitlines()[-15:])
        raise SystemExit(f"tutorial: `{shown(args)}` exited {child.returncode}:\n{tail}")
    return stdout


def closing_table(stdout: str, work: Path) -> str:
    """The closing table a run printed, less its timing lines, its run folder relative to the work folder."""
    lines = [line.replace(f"{work}/", "") for line in stdout.strip("\n").splitlines()
             if not line.strip().startswith(UNTIMED)]
    return "\n".join(lines)


def report_parts(report_md: str) -> tuple[str, list[str]]:
    """report.md's table (with the line that heads it) and the lines under it (the privacy of choosing), less the
    figure list."""
    head, _, rest = report_md.partition("\n\nThe privacy")
    under = [line for line in ("The privacy" + rest).strip().splitlines()
             if line.strip() and not line.startswith("Figures:")] if rest else []
    return head.strip(), under


def cells(report_csv: Path) -> dict[tuple[str, str], dict]:
    """report.csv's cells by (method, ε)."""
    with open(report_csv, newline="") as f:
        return {(r["method"], r["epsilon"]): r for r in csv.DictReader(f)}


def memory_figure(plans: list[dict], folder: Path) -> tuple[str, str, float]:
    """A stacked bar per planned method (its peak's breakdown) into folder/memory.png; returns (file, unit, scale)."""
    peak = max(p["peak_bytes"] for p in plans)
    unit, scale = ("GiB", GIB) if peak >= GIB else ("MiB", 2**20)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    labels = [p["label"].removeprefix("method=") for p in plans]
    left = [0.0] * len(plans)
    parts = [k for k in PARTS if any(p["breakdown"].get(k) for p in plans)]
    for part in parts:
        sizes = [p["breakdown"].get(part, 0) / scale for p in plans]
        ax.barh(labels, sizes, left=left, label=part.replace("_", " "))
        left = [a + b for a, b in zip(left, sizes)]
    for y, p in enumerate(plans):
        ax.annotate(f"{p['peak_bytes'] / scale:.2f}", (p["peak_bytes"] / scale, y), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8)
    first = plans[0]
    ax.invert_yaxis()
    ax.set_xlim(0, peak / scale * 1.12)
    ax.set(xlabel=f"planned peak memory ({unit})",
           title=f"{first['model']}, batch {first['batch_size']}: peak memory by method (planned on meta)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
    return save_figure(fig, folder, "memory", formats=("png",))[0], unit, scale


def page(s: Sizes, cmds: dict, outputs: dict, work: Path, figures: Path, header: str) -> str:
    """The tutorial's markdown."""
    runs = work / RUNS
    summary = json.loads((runs / "dp-adam-eps8" / "summary.json").read_text())
    report = runs / "sweep" / "report"
    table, under = report_parts((report / "report.md").read_text())
    by_cell = cells(report / "report.csv")
    composed = next((re.search(r"ε = ([\d.]+) at δ = (\S+?)\s", line) for line in under if "ε =" in line), None)
    top = s.epsilons[-1].removeprefix("eps")

    def accuracy(method, eps):
        c = by_cell.get((method, eps))
        if not c or not c["mean"]:
            return "no result"
        se = f" ± {100 * float(c['se']):.1f}" if c["se"] else ""
        return f"{100 * float(c['mean']):.1f}{se} %"

    plans = json.loads((runs / "memory" / "memory.json").read_text())["plans"]
    memory_png, unit, scale = memory_figure(plans, figures)
    first = plans[0]
    n_runs = len(s.epsilons) * len(s.seeds) * 2
    seeds = "one seed" if len(s.seeds) == 1 else f"{len(s.seeds)} seeds"

    def block(*names):
        return "```bash\n" + "".join(shown(cmds[n]) + "\n" for n in names) + "```\n"

    memory_rows = [[f"`{p['label'].removeprefix('method=')}`", KEEPS.get(p["label"], ""),
                    f"**{p['peak_bytes'] / scale:.2f}**",
                    *(f"{p['breakdown'].get(k, 0) / scale:.2f}" for k in PARTS if k != "noise_buffers")]
                   for p in plans]
    memory_head = ["method", "what it keeps", f"peak {unit}", "parameters", "gradients", "per-sample",
                   "optimizer state", "activations", "temporaries"]
    planned = {p["label"]: p for p in plans}
    bk, materialize = planned["method=dp-adam"], planned["method=dp-adam-materialize"]

    return "\n".join([
        header,
        "",
        *(["!!! warning \"A toy run\"", "    Written by `--tiny` (the test's): 3 steps a run, 2 ε, one seed, a "
           "tiny model planned. Its numbers say nothing about the methods.", ""] if s.tiny else []),
        "This page is **generated**: every command below ran as shown, in a fresh folder, and every table, output "
        "and figure is what it printed or wrote (the closing table less its throughput and wall-time lines). "
        "Regenerate it with the command above, from the repository root; `tests/test_tutorial.py` runs the same "
        "script at toy size, so the page cannot drift from the commands. Each `dpmem train` below, of the default "
        "length, takes about 20 s on 2 idle CPU cores ([the default run](getting-started.md#the-default-run)).",
        "",
        "It takes one task from its data to a private fine-tune, to the ε it spent and its accuracy against ε, "
        "then plans the memory each method needs on a realistic model.",
        "",
        "## 1. The task",
        "",
        "The default task: a small ViT (`model=vit-tiny`, 2 blocks 64 wide, trained from scratch) on scikit-learn's "
        "bundled digits (`data=digits`): 1,797 real 8×8 grey-scale images of the digits 0–9, split once, "
        "stratified, into 1,437 training and 360 test images. It ships with scikit-learn, so nothing is "
        "downloaded. The 1,437 training images are the private data: ε below is about them.",
        "",
        "To point dpmem at your own data instead, pass `data=npz data.path=FILE.npz` (images) or "
        "`data=csv|jsonl data.path=FILE` (text), or a Hugging Face checkpoint as `model.pretrained=`: see "
        "[tasks, data and models](getting-started.md#tasks-data-and-models) and "
        "[your own model and data](opacus.md#your-own-model-and-data).",
        "",
        "## 2. One private run",
        "",
        "DP-Adam at ε = 8 (`privacy=eps8`), its run folder named with `hydra.run.dir`:",
        "",
        block("run"),
        "It ends by printing its closing table:",
        "",
        "```text",
        closing_table(outputs["run"], work),
        "```",
        "",
        f"- **ε spent / target**: the run spent ε = {summary['epsilon_spent']:.3f} of its target "
        f"{summary['epsilon_target']:g}. Before training, dpmem calibrated the noise to the budget: σ is the "
        f"noise multiplier (σ = {summary['sigma']:.4g} here), the Gaussian noise's standard deviation in units "
        f"of the clipping norm C = {summary['max_grad_norm']:g} (`method.max_grad_norm`), for "
        f"{summary['steps']} steps of Poisson-sampled batches of expected size {summary['batch_size']} (rate "
        f"q = {summary['batch_size']}/{summary['n_train']} = {summary['sample_rate']:.3f}), by the "
        f"{summary['accountant']} accountant. Fewer steps or a larger ε need less noise.",
        f"- **δ** = {summary['delta']:g}: the probability with which the ε guarantee may fail. `privacy.delta=auto` "
        "(the default) takes min(1e-5, 1/n^1.1) for n training records: well below 1/n, as it must be "
        "(what ε and δ mean, and how to pick them: the [FAQ](faq.md#what-do-and-mean-and-which-should-i-pick)).",
        "- **The run folder** (`hydra.run.dir`; without it `outputs/train/DATE/TIME_METHOD`) holds `config.yaml`, "
        "`summary.json` (status, ε target and spent, δ, σ, q, steps, the final and best accuracy, peak memory), "
        "`metrics.jsonl` (loss, learning rate and ε spent so far, step by step) and `privacy.jsonl`, the "
        "append-only ledger of the ε each attempt spent. Each file, the exit codes and resuming: "
        "[run folders](run-folders.md).",
        "- Launched again into the same folder, a finished run is refused (its record is kept); pass another "
        "`hydra.run.dir`, or `train.overwrite=true`.",
        "",
        "## 3. A sweep: accuracy against ε",
        "",
        f"dp-adam and DP-GRAPE (`grape`) at ε = {', '.join(e.removeprefix('eps') for e in s.epsilons)} over "
        f"{seeds} (`train.seed`): {n_runs} runs one after another, one folder each under a fixed "
        "`hydra.sweep.dir`; then a non-private Adam baseline; then `dpmem report` on both folders:",
        "",
        block("sweep", "baseline", "report"),
        f"`dpmem report` writes `report.md`, `report.csv`, `report.tex` and its figures into the first folder's "
        f"`report/` (here `{RUNS}/sweep/report/`). `report.md` starts with the table:",
        "",
        table,
        "",
        "Its figure of accuracy against ε (`accuracy_vs_epsilon_digits.png`; the dashed line is the non-private "
        "baseline):",
        "",
        "![Final test accuracy against ε for dp-adam and grape on digits, mean ± standard error over seeds, "
        "with the non-private Adam baseline](tutorial/accuracy-vs-epsilon.png)",
        "",
        f"At ε = {top}, dp-adam reached {accuracy('dp-adam', top)} and grape {accuracy('grape', top)}; "
        f"non-private Adam {accuracy('adam', 'non-private')} "
        f"({f'private rows: mean ± standard error over {seeds}' if len(s.seeds) > 1 else 'one seed'}; "
        "each private run draws its noise and batches afresh from the OS, so a rerun's numbers "
        "differ within about the standard error).",
        "",
        "Under the table, the report says what choosing among these runs costs:",
        "",
        "```text",
        *under,
        "```",
        "",
        "Each run is (ε, δ)-DP on its own. But publishing the best of them (the best method, the best learning "
        "rate, the best ε for a given accuracy) is a choice made by looking at all of them, so it releases all of "
        f"them: their privacy losses compose. Here the {n_runs} private runs, each at ε ≤ {top}, compose to "
        + (f"ε = {composed.group(1)} at δ = {composed.group(2)}" if composed else "the ε the report prints")
        + ", not the largest single ε. The non-private baseline, trained on the same records, is a release outside "
        "any ε: fine for a tutorial, not for data that must stay private (tune on public or held-out data, or "
        "use a [private search](privacy.md#private-selection) whose whole cost is its budget; see "
        "[searching on private data](privacy.md#searching-on-private-data)).",
        "",
        "**A fixed σ instead of a target ε.** To sweep the noise multiplier itself, as Opacus' "
        "`make_private(noise_multiplier=...)` does, give `privacy.noise_multiplier=σ` in place of `privacy=epsN`: "
        "`dpmem train method=dp-adam privacy.noise_multiplier=1.0` (not run here) spends, ledgers and reports the "
        "ε that σ, the rate and the steps give, and the report shows that row's ε as \"ε (σ 1)\" and composes it "
        "as any other ([a fixed σ](privacy.md#fixed-sigma)).",
        "",
        "## 4. Peak memory by method",
        "",
        f"`dpmem memory` plans a run's peak memory before you rent a GPU: it runs {first['steps']} real training "
        "steps of each method, and the run's evaluation, on PyTorch's `meta` device, where nothing is allocated and "
        "no weights are downloaded, and counts every tensor that would be live. Here on "
        + ("a tiny RoBERTa" if s.tiny else "RoBERTa-base (125M parameters, random init from its architecture)")
        + f" at a batch of {first['batch_size']} sequences of {first['input_shape'][0]} tokens, 2 classes "
        "(`data=synthetic` gives the shape of SST-2 offline):",
        "",
        block("memory"),
        "![Planned peak memory by method, each bar split into parameters, gradients, per-sample gradients, "
        "optimizer state, activations and temporaries](tutorial/memory.png)",
        "",
        *markdown_table(memory_head, memory_rows),
        "",
        f"Planned on the meta device for a CUDA target (`memory.json` in `{RUNS}/memory/`), {unit} = "
        f"2^{30 if unit == 'GiB' else 20} bytes; the parts are what was live at the peak. A GPU's allocator "
        "reserves about 10 % more (`memory.allocator_overhead`). Book-keeping clipping plans "
        f"{bk['peak_bytes'] / scale:.2f} {unit} where materialising the per-sample gradients plans "
        f"{materialize['peak_bytes'] / scale:.2f} {unit}: the difference is the per-sample column, B "
        "per-sample gradients held at once where book-keeping keeps their norms. The largest batch that fits a "
        "budget (`memory.budget=24GB`), activation checkpointing and how "
        "the plan compares with a measured run: [memory planning](memory.md).",
        "",
        "## 5. What next",
        "",
        "- [Methods](methods.md): what each private step does, the clipping modes, precision and "
        "`train.compile`.",
        "- [Privacy](privacy.md): the accountants, δ, the ledger, what a run releases, private selection, "
        "auditing a run.",
        "- [Configuration reference](configuration.md): every key of every group, its type, default and meaning.",
        "- [FAQ and troubleshooting](faq.md): a run that does not learn, runs out of memory or cannot reach the "
        "hub.",
        "- [Coming from Opacus](opacus.md): Opacus' names mapped to dpmem's keys, and your own model and data.",
        "",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="every command at toy size (needs --out): the test's")
    ap.add_argument("--out", type=Path, default=None,
                    help="the docs folder the page (OUT/tutorial.md) and its figures (OUT/tutorial/) go to "
                         "(default: docs/)")
    ap.add_argument("--work", type=Path, default=None,
                    help="the folder the commands run in (default: a temporary one, deleted at the end)")
    ap.add_argument("--jobs", type=int, default=1, help="independent commands run at a time (default 1)")
    args = ap.parse_args()
    if args.tiny and args.out is None:
        ap.error("--tiny writes a toy page: give it an --out folder (the committed docs/tutorial.md stays)")
    out = args.out or ROOT / "docs"
    sizes = Sizes(args.tiny)
    cmds = commands(sizes)
    # the header's command: this script's, its folders as given (a temporary --out as OUT, not this machine's path)
    header = provenance(machine())
    for given, name in ((args.out, "OUT"), (args.work, "WORK")):
        if given is not None and given.is_absolute():
            header = header.replace(shlex.quote(str(given)), name)
    header = ("# Tutorial: from data to a private fine-tune, ε and accuracy\n\n"
              + header.replace("Written by", "Generated by"))

    with tempfile.TemporaryDirectory(prefix="dpmem-tutorial-") as temporary:
        work = (args.work or Path(temporary)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        if (work / RUNS).exists():
            raise SystemExit(f"tutorial: {work / RUNS} exists: give an empty --work folder")
        outputs = {}

        def step(name):
            outputs[name] = run(cmds[name], work)

        if warm_start.available():
            warm_start.preload()  # what each command imports, once: its process is forked from this one
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # the report waits for the sweep and the baseline
            for done in [pool.submit(step, n) for n in ("run", "sweep", "baseline", "memory")]:
                done.result()
        step("report")

        figures = out / "tutorial"
        figures.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / RUNS / "sweep" / "report" / "accuracy_vs_epsilon_digits.png",
                        figures / "accuracy-vs-epsilon.png")
        text = page(sizes, cmds, outputs, work, figures, header)
        (figures / "commands.txt").write_text("".join(shown(cmds[n]) + "\n" for n in cmds))
        write_markdown(out / "tutorial.md", text)


if __name__ == "__main__":
    main()
