"""The report's figures (PNG and PDF), each drawn only when the runs hold what it needs:
- accuracy vs ε: per data set, the final metric's mean ± standard error against ε, one line per method;
- memory vs batch size: peak memory against the physical batch size, one line per method and model;
- development metric vs step: the evaluations of runs with train.eval_every, averaged over seeds;
- σ vs k: the noise multiplier of dp-sgd-rc runs against the number of probes, one line per d;
- excess loss vs dimension (Li et al. 2022 Fig. 1): data=median runs, one line per A."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from dpmem.report import pyplot, save_figure
from dpmem.report.labels import PROBLEM, row_label


def write(out: Path, summaries: list[dict], table_cells: dict) -> list[str]:
    """Every figure the runs allow, into `out`; returns the file names."""
    plt, written = pyplot(), []
    ok = [s for s in summaries if s["status"] == "ok"]
    # accuracy vs epsilon
    for data in sorted({d for _, _, d in table_cells}):
        lines = defaultdict(list)
        for (row, eps, d), c in table_cells.items():
            if d == data and c["n"] and c["private"]:  # not the non-private rows, nor the seeded ones (ε ∞)
                lines[row].append((float(eps), 100 * c["mean"], 100 * (c["se"] or 0.0)))
        if not any(len(v) > 1 for v in lines.values()):
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for row, points in sorted(lines.items()):
            points.sort()
            ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points], marker="o",
                        capsize=3, label=row)
        for (row, eps, d), c in table_cells.items():
            if d == data and eps == "non-private" and c["n"]:
                ax.axhline(100 * c["mean"], linestyle="--", color="gray", linewidth=1)
                ax.annotate(f"{row} (non-private)", (ax.get_xlim()[0], 100 * c["mean"]), fontsize=7)
        ax.set(xlabel="ε", ylabel="final metric (%)", title=f"{data}: metric vs ε (mean ± s.e. over seeds)")
        ax.legend(fontsize=8)
        written += save_figure(fig, out, f"accuracy_vs_epsilon_{data}")
    # memory vs batch size
    memory = defaultdict(dict)
    for s in ok:
        if s.get("peak_memory_bytes"):
            memory[(s["method"], s.get("model"), s.get("peak_memory_source"))][s.get("physical_batch_size")] = \
                s["peak_memory_bytes"] / 2**30
    if any(len(v) > 1 for v in memory.values()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for (row, model, source), points in sorted(memory.items(), key=lambda kv: str(kv[0])):
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], "o-", label=f"{row}, {model}")
        sources = sorted({str(k[2]) for k in memory})
        ax.set(xlabel="physical batch size", ylabel="peak memory (GiB)", xscale="log",
               title=f"Peak memory ({', '.join(sources)})")
        ax.legend(fontsize=8)
        written += save_figure(fig, out, "memory_vs_batch")
    # development metric vs step
    curves = defaultdict(lambda: defaultdict(list))
    for s in ok:
        metrics = Path(s["run_dir"]) / "metrics.jsonl"
        name = s.get("metric_name")
        if not metrics.exists() or name is None:
            continue
        for line in metrics.read_text().splitlines():
            r = json.loads(line)
            if name in r and not r.get("final"):
                curves[(row_label(s), s.get("epsilon_target"), s["data"])][r["step"]].append(100 * r[name])
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for (row, eps, data), by_step in sorted(curves.items(), key=lambda kv: str(kv[0])):
            steps = sorted(by_step)
            ax.plot(steps, [statistics.fmean(by_step[t]) for t in steps], label=f"{row}, ε={eps}, {data}")
        ax.set(xlabel="step", ylabel="development metric (%)", title="Metric during training (mean over seeds)")
        ax.legend(fontsize=7)
        written += save_figure(fig, out, "metric_vs_step")
    # sigma vs k (randomized clipping)
    sigmas = defaultdict(dict)
    for s in summaries:
        rc = s.get("rc_accountant")
        if rc and s.get("sigma") is not None:
            sigmas[(rc.get("d"), rc.get("estimator"), s.get("epsilon_target"))][rc["k"]] = s["sigma"]
    if any(len(v) > 1 for v in sigmas.values()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for (d, estimator, eps), points in sorted(sigmas.items(), key=lambda kv: str(kv[0])):
            ks = sorted(points)
            ax.plot(ks, [points[k] for k in ks], "o-", label=f"{estimator}, d={d}, ε={eps}")
        ax.set(xlabel="k (probes)", ylabel="σ", xscale="log", title="DP-SGD-RC noise multiplier vs k")
        ax.legend(fontsize=8)
        written += save_figure(fig, out, "sigma_vs_k")
    written += _excess_loss_vs_dimension(plt, out, ok)
    return written


MEDIAN_METRICS = (("excess_empirical_loss", "excess empirical loss"),
                  ("excess_population_loss", "excess population loss"))


def _without_problem(s: dict) -> str:
    """The run's row label without the problem's settings (A, dimension, ...), which are the figure's lines and
    axis."""
    problem = {key.split(".", 1)[1] for key in PROBLEM}
    kept = [part for part in (s.get("variant") or "").split(", ") if part and part.split("=", 1)[0] not in problem]
    return f"{s['method']} ({', '.join(kept)})" if kept else s["method"]


def _excess_loss_vs_dimension(plt, out: Path, ok: list[dict]) -> list[str]:
    """Li et al. 2022 Fig. 1: data=median runs' excess empirical and population loss against the dimension d, one
    line per A (and method, ε where several), mean ± one standard deviation over seeds."""
    points = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for s in ok:
        config, metrics = s.get("config", {}), s.get("metrics") or {}
        if s["data"] != "median" or "data.dimension" not in config or not metrics:
            continue
        line = (config.get("data.A"), _without_problem(s), s.get("epsilon_target"))
        for name, _ in MEDIAN_METRICS:
            if name in metrics:
                points[name][line][config["data.dimension"]].append(metrics[name])
    if not any(len(by_d) > 1 for lines in points.values() for by_d in lines.values()):
        return []
    fig, axes = plt.subplots(1, len(MEDIAN_METRICS), figsize=(11, 4))
    several = len({line[1:] for lines in points.values() for line in lines}) > 1
    for ax, (name, title) in zip(axes, MEDIAN_METRICS):
        for (A, row, eps), by_d in sorted(points[name].items(), key=lambda kv: str(kv[0])):
            ds = sorted(by_d)
            ax.errorbar(ds, [statistics.fmean(by_d[d]) for d in ds], marker="o", capsize=3,
                        yerr=[statistics.stdev(by_d[d]) if len(by_d[d]) > 1 else 0.0 for d in ds],
                        label=f"A_{A}" + (f", {row}, ε={eps}" if several else ""))
        ax.set(xlabel="dimension d", ylabel=title, xscale="log", title=f"{title} (mean ± 1 s.d. over seeds)")
        ax.legend(fontsize=8)
    return save_figure(fig, out, "excess_loss_vs_dimension")
