"""One table of every method on one model: planned peak memory, samples/s and accuracy at ε = 8, as a markdown page
with a bar plot beside it.

    python scripts/methods_table.py          # roberta-base, SST-2-shaped (T = 128, 2 classes), B = 32; 1-2 minutes

The peaks are planned here, by `dpmem memory` on the meta device (nothing allocated, no weights), for each method
and clipping mode. Every other figure is read from the page that measured it, and its cell names that page (a key
into the page's source list: the page, its device, commit, date and command):

- samples/s on a GPU from docs/benchmarks/peers-cuda-tf32.md (eager) and compile-cuda-tf32.md (compiled), where
  the method was measured there;
- for a method with no GPU figure, its samples/s × adam's on the CPU from docs/benchmarks/methods.md;
- accuracy at ε = 8 from docs/reproductions.md.

A figure the table cites but cannot find on its page (a row renamed, a column gone) is an error naming the page and
the row: the script stops, and writes nothing. The model is planned with its embeddings frozen, as the GPU pages
measured it. `--model`, `--batch-size`, `--seq-len` plan another shape (the speed and accuracy cells stay the
pages' own). Writes docs/benchmarks/methods-table.md and methods-table.png beside it (`--out` writes elsewhere)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import dpmem.cli
from dpmem.report import GIB, benchmark_page, machine, markdown_table, page_header, pyplot, save_figure, write_markdown
from dpmem.report.pages import Page, number

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "benchmarks"

# the `dpmem memory` sweeps that plan every row, each with the labels its plans carry, in order
SWEEPS = [
    (["method=adam,dp-adam,dp-sgd,grape,galore-dp-naive,dp-sgd-rc,dpzero,galore,mezo"],
     ["method=adam", "method=dp-adam", "method=dp-sgd", "method=grape", "method=galore-dp-naive",
      "method=dp-sgd-rc", "method=dpzero", "method=galore", "method=mezo"]),
    (["method=dp-adam", "method.clipping=ghost,mixed,materialize,fgc"],
     ["method.clipping=ghost", "method.clipping=mixed", "method.clipping=materialize", "method.clipping=fgc"]),
    (["method=dp-sgd-rc", "method.bookkeeping=true"], ["dp-sgd-rc"]),
]
GPU_BATCH = "32"  # the B of the GPU pages' rows (roberta-base, T = 128)
CPU_BATCH = "32"  # the B of methods.md's rows quoted (ViT-tiny, 8×8 images)


@dataclass
class Row:
    method: str  # the overrides that select it, as a user writes them
    short: str  # its name in the plot
    plan: tuple[int, str]  # (sweep, label) of its `dpmem memory` plan
    gpu: str | None = None  # its contestant on peers-cuda-tf32.md
    compiled: str | None = None  # its contestant on compile-cuda-tf32.md
    cpu: str | None = None  # its method on methods.md (the CPU), where no GPU figure exists
    accuracy: str | None = None  # its row of reproductions.md's accuracy table; "dpzero": the convergence line
    accuracy_note: str = ""  # what stands in the accuracy cell when there is no figure, or beside it


ROWS = [
    Row("`method=adam` (non-private)", "adam", (0, "method=adam"), gpu="torch AdamW (non-private)",
        compiled="torch AdamW (non-private), compiled", accuracy_note="non-private"),
    Row("`method=dp-adam` (bk clipping, the default)", "dp-adam (bk)", (0, "method=dp-adam"), gpu="dpmem dp-adam (bk)",
        compiled="dpmem dp-adam (bk), compiled", accuracy="dp-adam, dpmem (ViT-tiny, digits)"),
    Row("`method=dp-adam method.clipping=ghost`", "dp-adam (ghost)", (1, "method.clipping=ghost"), gpu="dpmem dp-adam (ghost)",
        accuracy="dp-adam, dpmem (ViT-tiny, digits)", accuracy_note="bk's: the same clipped sum"),
    Row("`method=dp-adam method.clipping=mixed`", "dp-adam (mixed)", (1, "method.clipping=mixed"), gpu="dpmem dp-adam (mixed)",
        accuracy="dp-adam, dpmem (ViT-tiny, digits)", accuracy_note="bk's: the same clipped sum"),
    Row("`method=dp-adam method.clipping=materialize`", "dp-adam (materialize)", (1, "method.clipping=materialize"),
        gpu="dpmem dp-adam (materialize)", accuracy="dp-adam, dpmem (ViT-tiny, digits)",
        accuracy_note="bk's: the same clipped sum"),
    Row("`method=dp-adam method.clipping=fgc`", "dp-adam (fgc)", (1, "method.clipping=fgc"),
        accuracy="dp-adam, dpmem (ViT-tiny, digits)", accuracy_note="bk's: the same clipped sum"),
    Row("`method=dp-sgd`", "dp-sgd (bk)", (0, "method=dp-sgd"), accuracy_note="none"),
    Row("`method=grape` (r = 16)", "grape", (0, "method=grape"), gpu="dpmem grape", compiled="dpmem grape, compiled",
        accuracy="grape, dpmem"),
    Row("`method=galore-dp-naive` (r = 16)", "galore-dp-naive", (0, "method=galore-dp-naive"), cpu="galore-dp-naive",
        accuracy="galore-dp-naive, dpmem"),
    Row("`method=dp-sgd-rc` (Hutchinson, k = 32, two passes)", "dp-sgd-rc (two passes)", (0, "method=dp-sgd-rc"),
        gpu="dpmem dp-sgd-rc (hutch, two passes)", accuracy_note="none at ε = 8"),
    Row("`method=dp-sgd-rc method.bookkeeping=true`", "dp-sgd-rc (bk)", (2, "dp-sgd-rc"), gpu="dpmem dp-sgd-rc (hutch, bk)",
        accuracy_note="none at ε = 8"),
    Row("`method=dpzero`", "dpzero", (0, "method=dpzero"), cpu="dpzero", accuracy="dpzero"),
    Row("`method=galore` (non-private)", "galore", (0, "method=galore"), cpu="galore", accuracy_note="non-private"),
    Row("`method=mezo` (non-private)", "mezo", (0, "method=mezo"), cpu="mezo", accuracy_note="non-private"),
]


def plan(args) -> tuple[dict[tuple[int, str], dict], list[str]]:
    """Every row's `dpmem memory` plan, keyed by (sweep, label), and the commands that made them."""
    common = [f"model={args.model}", "data=synthetic", f"data.seq_len={args.seq_len}", "data.num_classes=2",
              f"train.batch_size={args.batch_size}", f"model.trainable=[{','.join(args.trainable)}]"]
    plans, commands = {}, []
    for i, (overrides, labels) in enumerate(SWEEPS):
        cmd = ["memory", *common, *overrides]
        with tempfile.TemporaryDirectory() as folder:
            # dpmem's own entry point in this process: a fresh interpreter per sweep cost its imports again
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                    dpmem.cli.main([*cmd, f"memory.dir={folder}"])
            except SystemExit as e:
                if e.code not in (0, None):
                    sys.exit(f"methods_table: dpmem {' '.join(cmd)} failed ({e.code}):\n{printed.getvalue()[-3000:]}")
            found = json.loads((Path(folder) / "memory.json").read_text())["plans"]
        if [p["label"] for p in found] != labels:
            sys.exit(f"methods_table: dpmem {' '.join(cmd)} planned {[p['label'] for p in found]}, not {labels}")
        plans.update({(i, p["label"]): p for p in found})
        commands.append(" ".join(["dpmem", "memory", *common[:-1], "\\\n   ", f"'{common[-1]}'", *overrides]))
    return plans, commands


def reproductions(page: Page) -> tuple[str, str]:
    """The commit and date of the reproductions page's accuracy table (`scripts/reproduce_mini.sh`)."""
    found = re.search(r"reproduce_mini\.sh[^)]*? on (\d{4}-\d{2}-\d{2}) at dpmem ([0-9a-f]{7,40})", page.text)
    if not found:
        raise LookupError(f"{page.path}: no 'reproduce_mini.sh ... on DATE at dpmem COMMIT' line")
    return found.group(2), found.group(1)


def dpzero_accuracy(page: Page) -> str:
    found = re.search(r"dpzero (\d+(?:\.\d+)?) ± (\d+(?:\.\d+)?) % after ([\d,]+) steps", page.text)
    if not found:
        raise LookupError(f"{page.path}: no 'dpzero A ± S % after N steps' (the convergence line)")
    return f"{found.group(1)} ± {found.group(2)} % after {found.group(3)} steps (chance)"


def rate(cell: str) -> str:
    """A samples/s cell as a plain number (1.24e+03 → 1240)."""
    value = number(cell)
    return f"{value:.0f}" if value >= 100 else f"{value:g}"


def link(key: str, page: str) -> str:
    return f"[{key}]({page})"


def cite() -> tuple[dict[str, dict], list[tuple], dict[str, str]]:
    """Every figure the table cites, read from its page: {row's method: {column: cell}} (the samples/s columns as
    (number, cell)), the sources (key, page, file name, what), and the figures its notes quote. Raises LookupError
    naming the page and row of a figure not found."""
    peers = Page(BENCH / "peers-cuda-tf32.md")
    compiled = Page(BENCH / "compile-cuda-tf32.md")
    cpu = Page(BENCH / "methods.md")
    repro = Page(ROOT / "docs" / "reproductions.md")
    cited = {}
    for row in ROWS:
        c = {}
        if row.gpu:
            r = peers.row(B=GPU_BATCH, contestant=row.gpu)
            c["gpu"] = (number(r["samples/s"]), f"{rate(r['samples/s'])} ({r['× AdamW']}× AdamW) "
                        + link("a", "peers-cuda-tf32.md"))
        if row.compiled:
            r = compiled.row("roberta-base", contestant=row.compiled)
            c["compiled"] = (number(r["samples/s"]), f"{rate(r['samples/s'])} ({r['× AdamW compiled']}× compiled "
                             f"AdamW) " + link("b", "compile-cuda-tf32.md"))
        if row.cpu:
            c["cpu"] = f"{cpu.cell('×adam 2', B=CPU_BATCH, method=row.cpu)}× adam " + link("c", "methods.md")
        if row.accuracy == "dpzero":
            c["accuracy"] = f"{dpzero_accuracy(repro)} " + link("d", "../reproductions.md#a-reproduction-that-fits-a-laptop")
        elif row.accuracy:
            figure = repro.cell("8", heading="A reproduction that fits a laptop", method=row.accuracy)
            note = f" ({row.accuracy_note})" if row.accuracy_note else ""
            c["accuracy"] = f"{figure} %{note} " + link("d", "../reproductions.md#a-reproduction-that-fits-a-laptop")
        else:
            c["accuracy"] = row.accuracy_note
        cited[row.method] = c
    sources = [("a", peers, "peers-cuda-tf32.md", "eager step, roberta-base, B = 32, T = 128, TF32, embeddings frozen;"
                " `torch.cuda.max_memory_allocated`"),
               ("b", compiled, "compile-cuda-tf32.md", "`train.compile=true` under CUDA graphs, roberta-base, B = 32,"
                " T = 128, TF32, embeddings frozen; at this commit the whole micro-batch, private arithmetic"
                " included, was one TF32 graph (a tf32 run now compiles its forward alone)"),
               ("c", cpu, "methods.md", "CPU, ViT-tiny on 8×8 images, B = 32: samples/s × adam's in one process (a"
                " host-bound step, not roberta-base's)")]
    validate = Page(BENCH / "validate-memory-cuda.md")
    ratios = validate.column("plan / allocated")
    notes = {"adam eager": rate(peers.cell("samples/s", B=GPU_BATCH, contestant="torch AdamW (non-private)")),
             "adam eager, compile page": rate(compiled.cell("samples/s", "roberta-base",
                                                            contestant="torch AdamW (non-private)")),
             "planner": f"{min(ratios):.2f}–{max(ratios):.2f}", "repro": reproductions(repro)}
    return cited, sources, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="roberta-base")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--trainable", nargs="+", default=["roberta.encoder.*", "classifier.*"],
                    help="model.trainable's patterns: the GPU pages froze the embeddings")
    ap.add_argument("--out", default=benchmark_page(__file__, "methods-table"))
    args = ap.parse_args()
    started = time.time()
    cited, sources, notes = cite()  # every cited figure, before the minutes of planning
    plans, commands = plan(args)
    adam = plans[ROWS[0].plan]["peak_bytes"]
    trainable = plans[ROWS[0].plan]["trainable_parameters"]
    head = ["method", "planned peak (GiB)", "× adam's peak", "GPU samples/s, eager", "GPU samples/s, compiled",
            "no GPU figure: CPU samples/s", "accuracy at ε = 8"]
    rows, bars = [], []
    for row in ROWS:
        p, c = plans[row.plan], cited[row.method]
        rows.append([row.method, f"{p['peak_bytes'] / GIB:.2f}", f"{p['peak_bytes'] / adam:.2f}",
                     c.get("gpu", (None, "none"))[1], c.get("compiled", (None, "-"))[1],
                     c.get("cpu", "-" if "gpu" in c else "none"), c["accuracy"]])
        bars.append((row.short, p["peak_bytes"] / GIB,
                     c.get("gpu", (None,))[0], c.get("compiled", (None,))[0]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure = plot(out, bars, f"{args.model}, B = {args.batch_size}, T = {args.seq_len}, embeddings frozen")
    commit, date = notes["repro"]
    source_rows = [[link(key, name), what, page.provenance().device, page.provenance().commit,
                    page.provenance().date, f"`{page.provenance().command}`"] for key, page, name, what in sources]
    source_rows.append([link("d", "../reproductions.md#a-reproduction-that-fits-a-laptop"),
                        "ViT-tiny trained from scratch on digits, ε = 8, δ = 1/n (the reproduction's δ, which the"
                        " FAQ warns against: dpmem's default is min(1e-5, 1/n^1.1)), final test accuracy, mean ± s.e."
                        " of 3 seeds (dpzero: 4,000 steps, `mini/steps-dpzero`)", "CPU, 2 cores", commit, date,
                        "`scripts/reproduce_mini.sh`"])
    details = (f"Planned peaks: `dpmem memory` on the meta device (CUDA's 512-byte rounding, the larger of 3 training "
               f"steps and the evaluation), {args.model} with a 2-class classifier head, synthetic tokens, T = "
               f"{args.seq_len}, B = {args.batch_size}, {trainable / 1e6:.2f}M trainable parameters (embeddings "
               "frozen, as the GPU pages ran it). Every other figure is read from the page its cell names, at that "
               "page's commit and date (sources below).")
    lines = [f"![Planned peak memory and GPU samples/s of every method]({figure.name})", "",
             *markdown_table(head, rows), "",
             "Sources: each figure's key links its page.", "",
             *markdown_table(["key", "what", "device", "commit", "date", "command"], source_rows), "",
             "The planned peaks, one `dpmem memory` sweep each:", "", "```bash", *commands, "```", "",
             "- **Compare speeds within one column.** The eager and compiled columns are two runs on the same GPU at "
             f"different commits, and their AdamW rates differ ({notes['adam eager']} and "
             f"{notes['adam eager, compile page']} samples/s eager).",
             "- **Accuracy is not on this model.** dpmem has not trained roberta-base privately yet; the ε = 8 figures "
             "are its CPU twin of the DP-GRAPE paper's ViT table. Every clipping mode of dp-adam computes the same "
             "clipped sum, so they share bk's figure. DPZero from scratch stays at chance; the paper fine-tunes.",
             "- **No speed figure** for `method.clipping=fgc` and `dp-sgd` (the same private step as dp-adam with "
             "SGD's update). galore, mezo, galore-dp-naive and dpzero have only the CPU's small ViT, where the step "
             "is the host's: read those ratios as an order, not as a GPU forecast.",
             f"- **Planned, not measured.** The planner was {notes['planner']} of CUDA's allocated peaks on an H200 "
             "([GPU: memory planner](validate-memory-cuda.md)); the GPU pages' own peaks measure the benchmark's "
             "process, not a run's plan.", ""]
    write_markdown(out, page_header("Every method on one model", machine("meta"), details, started)
                   + "\n".join(lines))


def plot(out: Path, bars, shape: str) -> Path:
    """Planned peak GiB beside GPU samples/s (eager, compiled) for each row, as OUT's stem .png."""
    plt = pyplot()
    labels = [b[0] for b in bars][::-1]
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(10, 5.5), sharey=True)
    y = range(len(labels))
    mem.barh(y, [b[1] for b in bars][::-1], color="tab:blue")
    mem.set(yticks=list(y), yticklabels=labels, xlabel="GiB", title=f"planned peak memory\n{shape}")
    for i, b in enumerate(bars[::-1]):
        mem.text(b[1], i, f" {b[1]:.2f}", va="center", fontsize=8)
    eager = [b[2] or 0 for b in bars][::-1]
    comp = [b[3] or 0 for b in bars][::-1]
    speed.barh([i + 0.2 for i in y], eager, height=0.4, color="tab:orange", label="eager")
    speed.barh([i - 0.2 for i in y], comp, height=0.4, color="tab:green", label="compiled")
    for i, (e, c) in enumerate(zip(eager, comp)):
        if not e and not c:
            speed.text(0, i, " no GPU figure", va="center", fontsize=8, color="gray")
    speed.set(xlabel="samples/s", title="samples/s on an NVIDIA H200\nroberta-base, B = 32, T = 128, TF32")
    speed.legend(loc="lower right", fontsize=8)
    mem.set_xlim(0, max(b[1] for b in bars) * 1.18)
    save_figure(fig, out.parent, out.stem, formats=("png",))
    return out.with_suffix(".png")


if __name__ == "__main__":
    main()
