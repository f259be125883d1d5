"""Memory plans as a markdown table, memory.json and figures: peak against batch size for every configuration,
and per configuration the peak's breakdown stacked by category."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from dpmem.metering import CATEGORIES
from dpmem.report import GIB, markdown_table, pyplot, save_figure
from dpmem.report.labels import file_name


def _size(x: float, scale: int = GIB) -> str:
    return f"{x / scale:.2f}"


def evaluated(evaluation: dict) -> str:
    """The evaluation batch, and the tokens generated for it (tasks that generate)."""
    tokens = evaluation["max_new_tokens"]
    return f"{evaluation['batch_size']}" + (f" + {tokens} tokens" if tokens else "")


def plans_table(rows: list[dict]) -> str:
    unit, scale = ("GiB", GIB) if max(r["reserved_estimate_bytes"] for r in rows) >= GIB else ("MiB", 2**20)
    head = (["configuration", "B", "physical B", "eval B", f"peak {unit}", f"training {unit}", f"evaluation {unit}",
             f"reserved est. {unit}"] + list(CATEGORIES) + ["plan s"])
    body = [[r["label"], str(r["batch_size"]), str(r["physical_batch_size"]), evaluated(r["evaluation"]),
             *(_size(x, scale) for x in (r["peak_bytes"], r["training"]["peak_bytes"], r["evaluation"]["peak_bytes"],
                                         r["reserved_estimate_bytes"], *(r["breakdown"][c] for c in CATEGORIES))),
             f"{r['wall_s']:.1f}"] for r in rows]
    return "\n".join(markdown_table(head, body))


def budget_table(budget: str, found: list[dict]) -> str:
    rows = []
    for f in found:
        plan = f["plan"]
        reserved = ("" if f["largest_batch"] else "does not fit at B = 1: ") + _size(plan["reserved_estimate_bytes"])
        if plan["peak_part"] == "evaluation":  # what a smaller train.eval_batch_size would lower
            reserved += f" (evaluation's, at eval B {evaluated(plan['evaluation'])})"
        largest = f"≥ {f['largest_batch']} (the search's limit)" if f.get("capped") else str(f["largest_batch"])
        rows.append([f["label"], largest, reserved])
    intro = (f"Largest batch (one physical batch) whose run's reserved estimate (training's or evaluation's, the "
             f"larger) fits {budget}:")
    return "\n".join([intro, "", *markdown_table(["configuration", "largest B", "reserved est. GiB at that B"], rows)])


def write(out: Path, rows: list[dict], budget: str | None = None, found: list[dict] | None = None) -> str:
    """memory.json, memory.md and (for batch-size sweeps) PNG figures in `out`; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    rows0 = rows[0] if rows else (found[0]["plan"] if found else {})
    text = (f"Planned peak memory of a run: {rows0.get('steps')} training steps on {rows0.get('device')}, the first "
            "unmetered, and its evaluation (eval B test examples in one batch, under no_grad, beside what training "
            "keeps; a generation task's tokens generated); peak = the larger of the two, its breakdown that part's; "
            f"tensors counted in {rows0.get('rounding')}; reserved estimate = peak × "
            f"(1 + {rows0.get('allocator_overhead')}); GiB = 2³⁰, MiB = 2²⁰ bytes.\n\n")
    if rows:
        text += plans_table(rows) + "\n"
    if found is not None:
        text += "\n" + budget_table(budget, found) + "\n"
    (out / "memory.json").write_text(json.dumps({"plans": rows, "budget": budget, "largest_batch": found},
                                                indent=2) + "\n")
    (out / "memory.md").write_text(text)
    _figures(out, rows)
    return text


def _figures(out: Path, rows: list[dict]) -> None:
    by_label = defaultdict(list)
    for r in rows:
        by_label[r["label"]].append(r)
    sweeps = {k: sorted(v, key=lambda r: r["batch_size"]) for k, v in by_label.items() if len(v) > 1}
    if not sweeps:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rs in sweeps.items():
        ax.plot([r["batch_size"] for r in rs], [r["reserved_estimate_bytes"] / GIB for r in rs], "o-", label=label)
    ax.set(xlabel="batch size", ylabel="reserved estimate (GiB)", xscale="log", title="Planned peak memory")
    _batch_ticks(ax, sorted({r["batch_size"] for rs in sweeps.values() for r in rs}))
    ax.legend()
    save_figure(fig, out, "memory_vs_batch", formats=("png",))
    for label, rs in sweeps.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [r["batch_size"] for r in rs]
        ax.stackplot(x, *[[r["breakdown"][c] / GIB for r in rs] for c in CATEGORIES], labels=CATEGORIES)
        ax.set(xlabel="batch size", ylabel="GiB at the peak", title=label)
        _batch_ticks(ax, x)
        ax.legend(loc="upper left", fontsize=8)
        save_figure(fig, out, f"memory_{file_name(label)}", formats=("png",))


def _batch_ticks(ax, batches: list[int]) -> None:
    """Ticks at the batch sizes planned, written out (a log axis alone shows 10⁰, 10¹, ...)."""
    from matplotlib.ticker import NullLocator
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.xaxis.set_minor_locator(NullLocator())
