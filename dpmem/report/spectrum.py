"""Spectra as spectrum.json, spectrum.csv, a markdown summary and figures (PNG and PDF)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from dpmem.report import markdown_table, pyplot, save_figure


def write(out: Path, result: dict) -> str:
    """spectrum.json, spectrum.csv, spectrum.md and the figures in `out`; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spectrum.json").write_text(json.dumps(result, indent=1) + "\n")
    table, lines = (_layer if result["mode"] == "layer" else _trajectory)(out, result)  # spectrum.csv's rows, the md
    with open(out / "spectrum.csv", "w", newline="") as f:
        csv.writer(f).writerows(table)
    text = "\n".join([f"Not private: {result['not_private_because']}.", "", *lines]) + "\n"
    (out / "spectrum.md").write_text(text)
    return text


def _ratio(values: list[float], i: int) -> str:
    return f"{values[i] / values[0]:.3f}" if len(values) > i and values[0] > 0 else "-"


def _layer(out: Path, result: dict) -> tuple[list[list], list[str]]:
    plt, table, rows = pyplot(), [["step", "clip", "sigma", "layer", "rank", "singular_value"]], []
    for st in result["steps"]:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for s in st["settings"]:
            n = s["mean_normalized"]
            for layer, values in [("mean", s["mean"]), ("mean_normalized", n), *s["per_layer"].items()]:
                table += ([st["step"], s["clip"], s["sigma"], layer, i + 1, v] for i, v in enumerate(values))
            rows.append([str(st["step"]), s["label"], f"{s['mean'][0]:.4g}", _ratio(n, 1), _ratio(n, 9),
                         _ratio(n, len(n) - 1), f"{s['slope']:.3f}"])
            ranks = range(1, len(s["mean"]) + 1)
            axes[0].plot(ranks, s["mean"], label=s["label"])
            axes[1].plot(ranks, n, label=s["label"])
        axes[0].set(xlabel="rank", ylabel="singular value (mean over layers)", yscale="log",
                    title=f"{result['model']} / {result['data']}, step {st['step']}")
        axes[1].set(xlabel="rank", ylabel="σᵢ / σ₁ (mean over layers)", title="shape of the decay")
        axes[0].legend(fontsize=8)
        save_figure(fig, out, f"spectrum_step{st['step']}")
    return table, [f"Top-{result['top']} singular values of the batch gradient of {len(result['layers'])} layers "
                   f"({result['model']} on {result['data']}: the matrices spectrum.layers picks), averaged over "
                   f"layers; ratios are of the layer-normalised mean (σᵢ/σ₁); slope = least-squares log σᵢ vs log i.",
                   "", *markdown_table(["step", "setting", "mean σ₁", "σ₂/σ₁", "σ₁₀/σ₁", "σ_last/σ₁", "slope"], rows)]


def _trajectory(out: Path, result: dict) -> tuple[list[list], list[str]]:
    values = result["singular_values"]
    g0 = result["G_k"].get("0") or math.nan
    lines = [f"PCA of {result['rows']} clipped mean gradients (p = {result['p']}) by orthogonal iteration "
             f"(k = {result['k']}, {result['iterations']} iterations).", "",
             f"- least-squares slope of log σᵢ against log i: {result['slope']:.3f} (Li et al.: about -0.6)",
             f"- σ₁ = {values[0]:.4g}, σ_k = {values[-1]:.4g}", "",
             *markdown_table(["k", "G_k = maxₜ ‖(I − V_kV_kᵀ) ḡₜ‖", "G_k / G_0"],
                             [[str(k), f"{g:.4g}", f"{g / g0:.3f}"] for k, g in result["G_k"].items()])]
    positive = [v for v in values if v > 0]
    ranks = list(range(1, len(positive) + 1))
    fig, axes = pyplot().subplots(1, 2, figsize=(10, 4))
    axes[0].loglog(ranks, positive, ".", label="σᵢ(H)")
    if math.isfinite(result["slope"]):
        fit = [math.exp(result["intercept"]) * i ** result["slope"] for i in ranks]
        axes[0].loglog(ranks, fit, "-", label=f"fit: slope {result['slope']:.2f}")
    axes[0].set(xlabel="rank i", ylabel="singular value", title=f"{result['rows']} clipped mean gradients")
    axes[0].legend()
    axes[1].plot([int(k) for k in result["G_k"]], list(result["G_k"].values()), "o-")
    axes[1].set(xlabel="k", ylabel="G_k proxy", title="maxₜ ‖(I − V_kV_kᵀ) ḡₜ‖")
    save_figure(fig, out, "spectrum_trajectory")
    return [["rank", "singular_value"], *([i + 1, v] for i, v in enumerate(values))], lines
