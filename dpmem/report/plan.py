"""A `dpmem plan` as plan.json, plan.md (the ranked table, the commands of the best few, what the estimate leaves
out) and plan.png/pdf (estimated samples/s against planned peak, the budget as a line)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from dpmem.engine.chooser import bands_text
from dpmem.engine.summary import json_ready
from dpmem.report import GIB, markdown_table, pyplot, save_figure

CAVEAT = ("Times are estimates from a roofline, not measurements: each op dispatched in the planned steps takes the "
          "longer of its FLOPs at the device's peak and its bytes at the device's bandwidth; a step takes the longer "
          "of the device's sum of those and the host's (ops × {host_op_us:.3g} µs: eager PyTorch dispatches every op "
          "from Python; on the CPU the two add up). Left out: dpmem's per-layer Python beyond the ops it dispatches, "
          "kernels below their peak (small matmuls), the allocator, data loading and evaluation; "
          "`train.compile=true` removes most host time, and its bound is the device-bound column. Peaks are the "
          "meta planner's (`dpmem memory`), reserved estimate = peak × (1 + memory.allocator_overhead); a "
          "configuration that does not fit shows a lower bound of its peak at physical batch 1 (from a quick plan, "
          "one micro-batch).")


def _privacy(row: dict) -> str:
    if row.get("sigma") is None:
        return "–"
    return f"σ = {row['sigma']:.3g}" + (f" for ε = {row['epsilon']:g}" if row.get("epsilon") is not None else "")


def _gib(x: float) -> str:
    return f"{x / GIB:.3g}"


def table(rows: list[dict], precisions: list[str]) -> str:
    head = (["#", "configuration", "physical B", "micro-batches", "peak GiB", "reserved GiB", "fits"]
            + [f"est. samples/s {p}" for p in precisions] + ["device-bound samples/s", "bound by", "privacy"])

    def cells(i: int, r: dict) -> list[str]:
        if not r["fits"]:
            return ["–", r["configuration"], "–", "–", f"≥ {_gib(r['peak_bytes'])} at 1",
                    _gib(r["reserved_estimate_bytes"]), "no", *["–"] * (len(precisions) + 3)]
        bound = "host" if r["host_seconds"] > r["device_seconds"] else "device"
        return [str(i), r["configuration"], str(r["physical_batch_size"]), str(r["micro_batches"]),
                _gib(r["peak_bytes"]), _gib(r["reserved_estimate_bytes"]), "yes",
                *(f"{r['estimates'][p]['samples_per_s']:.3g}" for p in precisions),
                f"{r['device_bound_samples_per_s']:.3g} ({r['precision']})", bound, _privacy(r)]
    return "\n".join(markdown_table(head, [cells(i, r) for i, r in enumerate(rows, 1)]))


def command(row: dict, overrides: list[str]) -> str:
    """The `dpmem train` command of a row: the user's overrides, then the row's own."""
    given = [o for o in overrides if not o.split("=", 1)[0].lstrip("+~").startswith(("plan.", "memory.", "hydra."))]
    words = [*given, *row["overrides"], f"train.physical_batch_size={row['physical_batch_size']}"]
    return "dpmem train " + " ".join(shlex.quote(o) for o in words)


def write(out: Path, result: dict, overrides: list[str], top: int) -> str:
    """plan.json, plan.md and the figure in `out`; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    device, budget, rows = result["device"], result["budget_bytes"], result["rows"]
    best = [r for r in rows if r["fits"]][:top]
    for r in rows:
        r["command"] = command(r, overrides) if r["fits"] else None
    text = (f"# dpmem plan: {result['model']} on {result['data']}, logical batch {result['batch_size']}, "
            f"{device['name']} with {budget / GIB:.3g} GiB\n\n"
            f"Device: {device['name']}: fp32 {device['fp32_tflops']:.3g} TFLOP/s, tf32 {device['tf32_tflops']:.3g} "
            f"TFLOP/s, {device['bandwidth_gbs']:.4g} GB/s ({device['source']}).\n\n"
            + CAVEAT.format(host_op_us=device["host_op_us"]) + "\n\n" + result["ranking"] + "\n\n"
            + table(rows, result["precisions"]) + "\n")
    # (a plan where nothing fits is an error before anything is written: dpmem.engine.chooser.nothing_fits)
    text += "\nThe best " + ("configuration" if len(best) == 1 else f"{len(best)} configurations") + ":\n\n"
    text += "\n".join(f"{i}. `{r['command']}`" for i, r in enumerate(best, 1)) + "\n"
    if result.get("bands_rule"):  # bandmf: how many bands fit beside each configuration that fits
        text += ("\nCorrelated noise: " + result["bands_rule"] + "\n\n"
                 + "\n".join(f"- `{r['command']}`: {bands_text(r['bands'], r['physical_batch_size'])}"
                             for r in best if r["bands"]) + "\n")
    if result["refused"]:
        text += "\nNot planned:\n\n" + "\n".join(f"- {r['configuration']}: {r['why']}"
                                                for r in result["refused"]) + "\n"
    (out / "plan.json").write_text(json.dumps(json_ready(result), indent=2, default=str) + "\n")
    (out / "plan.md").write_text(text)
    _figure(out, rows, budget)
    return text


def _figure(out: Path, rows: list[dict], budget: int) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for checkpointing, marker in ((False, "o"), (True, "^")):
        fits = [r for r in rows if r["fits"] and r["checkpointing"] == checkpointing]
        if fits:
            ax.scatter([r["reserved_estimate_bytes"] / GIB for r in fits], [r["samples_per_s"] for r in fits],
                       marker=marker, label="activation checkpointing" if checkpointing else "no checkpointing")
            for r in fits:
                short = " ".join(o.split("=", 1)[1] for o in r["overrides"] if o.startswith("method"))
                ax.annotate(short, (r["reserved_estimate_bytes"] / GIB, r["samples_per_s"]), fontsize=6)
    ax.axvline(budget / GIB, color="red", linestyle="--", label="budget")
    ax.set(xlabel="reserved estimate (GiB)", ylabel="estimated samples/s", title="Configurations that fit")
    ax.legend(fontsize=8)
    save_figure(fig, out, "plan")
