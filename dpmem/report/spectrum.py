"""Spectra as spectrum.json, spectrum.csv, a markdown summary and figures (PNG and PDF)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from dpmem.report import pyplot, save_figure


def write(out: Path, result: dict) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "spectrum.json").write_text(json.dumps(result, indent=1) + "\n")
    text = _layer(out, result) if result["mode"] == "layer" else _trajectory(out, result)
    text = f"Not private: {result['not_private_because']}.\n\n" + text
    (out / "spectrum.md").write_text(text)
    return text


def _ratio(values: list[float], i: int) -> str:
    return f"{values[i] / values[0]:.3f}" if len(values) > i and values[0] > 0 else "-"


def _layer(out: Path, result: dict) -> str:
    with open(out / "spectrum.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "clip", "sigma", "layer", "rank", "singular_value"])
        for st in result["steps"]:
            for s in st["settings"]:
                rows = [("mean", s["mean"]), ("mean_normalized", s["mean_normalized"]), *s["per_layer"].items()]
                for layer, values in rows:
                    w.writerows([st["step"], s["clip"], s["sigma"], layer, i + 1, v] for i, v in enumerate(values))
    lines = [f"Top-{result['top']} singular values of the batch gradient of {len(result['layers'])} layers "
             f"({result['model']} on {result['data']}: the matrices spectrum.layers picks), averaged over layers; "
             f"ratios are of the layer-normalised mean (σᵢ/σ₁); slope = least-squares log σᵢ vs log i.", "",
             "| step | setting | mean σ₁ | σ₂/σ₁ | σ₁₀/σ₁ | σ_last/σ₁ | slope |", "|---|---|---|---|---|---|---|"]
    for st in result["steps"]:
        for s in st["settings"]:
            n = s["mean_normalized"]
            lines.append(f"| {st['step']} | {s['label']} | {s['mean'][0]:.4g} | {_ratio(n, 1)} | {_ratio(n, 9)} | "
                         f"{_ratio(n, len(n) - 1)} | {s['slope']:.3f} |")
    _layer_figure(out, result)
    return "\n".join(lines) + "\n"


def _trajectory(out: Path, result: dict) -> str:
    values = result["singular_values"]
    with open(out / "spectrum.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rank", "singular_value"])
        w.writerows([i + 1, v] for i, v in enumerate(values))
    lines = [f"PCA of {result['rows']} clipped mean gradients (p = {result['p']}) by orthogonal iteration "
             f"(k = {result['k']}, {result['iterations']} iterations).", "",
             f"- least-squares slope of log σᵢ against log i: {result['slope']:.3f} (Li et al.: about -0.6)",
             f"- σ₁ = {values[0]:.4g}, σ_k = {values[-1]:.4g}", "",
             "| k | G_k = maxₜ ‖(I − V_kV_kᵀ) ḡₜ‖ | G_k / G_0 |", "|---|---|---|"]
    g0 = result["G_k"].get("0") or math.nan
    for k, g in result["G_k"].items():
        lines.append(f"| {k} | {g:.4g} | {g / g0:.3f} |")
    _trajectory_figure(out, result)
    return "\n".join(lines) + "\n"


def _layer_figure(out: Path, result: dict) -> None:
    plt = pyplot()
    for st in result["steps"]:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for s in st["settings"]:
            ranks = range(1, len(s["mean"]) + 1)
            axes[0].plot(ranks, s["mean"], label=s["label"])
            axes[1].plot(ranks, s["mean_normalized"], label=s["label"])
        axes[0].set(xlabel="rank", ylabel="singular value (mean over layers)", yscale="log",
                    title=f"{result['model']} / {result['data']}, step {st['step']}")
        axes[1].set(xlabel="rank", ylabel="σᵢ / σ₁ (mean over layers)", title="shape of the decay")
        axes[0].legend(fontsize=8)
        save_figure(fig, out, f"spectrum_step{st['step']}")


def _trajectory_figure(out: Path, result: dict) -> None:
    plt = pyplot()
    values = [v for v in result["singular_values"] if v > 0]
    ranks = list(range(1, len(values) + 1))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].loglog(ranks, values, ".", label="σᵢ(H)")
    if math.isfinite(result["slope"]):
        fit = [math.exp(result["intercept"]) * i ** result["slope"] for i in ranks]
        axes[0].loglog(ranks, fit, "-", label=f"fit: slope {result['slope']:.2f}")
    axes[0].set(xlabel="rank i", ylabel="singular value", title=f"{result['rows']} clipped mean gradients")
    axes[0].legend()
    ks = [int(k) for k in result["G_k"]]
    axes[1].plot(ks, list(result["G_k"].values()), "o-")
    axes[1].set(xlabel="k", ylabel="G_k proxy", title="maxₜ ‖(I − V_kV_kᵀ) ḡₜ‖")
    save_figure(fig, out, "spectrum_trajectory")
