"""The report's figures (PNG and PDF), each drawn only when the runs hold what it needs: per data set the final
metric's mean ± standard error against ε, peak memory against the physical batch size, the development metric
against the step (runs with train.eval_every, averaged over seeds), dp-sgd-rc's σ against its probes k, and excess
loss against the dimension (data=median runs, Li et al. 2022 Fig. 1)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from dpmem.report import GIB, pyplot, save_figure
from dpmem.report.labels import PROBLEM, USER, epsilon_number, row_label


def write(out: Path, summaries: list[dict], table_cells: dict) -> list[str]:
    """Every figure the runs allow, into `out`; returns the file names."""
    plt, written = pyplot(), []
    ok = [s for s in summaries if s["status"] == "ok"]
    for data in sorted({d for _, _, d in table_cells}):
        lines = defaultdict(list)
        for (row, eps, d), c in table_cells.items():
            if d == data and c["n"] and c["private"]:  # not the non-private rows, nor the seeded ones (ε ∞)
                # a user-level ε is another guarantee: its runs are a line of their own, labelled so
                user = eps.endswith(USER)
                lines[row + (USER if user else "")].append((epsilon_number(eps), 100 * c["mean"],
                                                            100 * (c["se"] or 0.0)))
        if not any(len(v) > 1 for v in lines.values()):
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for row, points in sorted(lines.items()):
            epsilons, means, errors = zip(*sorted(points))
            ax.errorbar(epsilons, means, yerr=errors, marker="o", capsize=3, label=row)
        for (row, eps, d), c in table_cells.items():
            if d == data and eps == "non-private" and c["n"]:
                ax.axhline(100 * c["mean"], linestyle="--", color="gray", linewidth=1)
                ax.annotate(f"{row} (non-private)", (ax.get_xlim()[0], 100 * c["mean"]), fontsize=7)
        ax.set(xlabel="ε", ylabel="final metric (%)", title=f"{data}: metric vs ε (mean ± s.e. over seeds)")
        ax.legend(fontsize=8)
        written += save_figure(fig, out, f"accuracy_vs_epsilon_{data}")
    memory = defaultdict(dict)
    for s in ok:
        if s.get("peak_memory_bytes"):
            memory[(s["method"], s.get("model"), s.get("peak_memory_source"))][s.get("physical_batch_size")] = \
                s["peak_memory_bytes"] / GIB
    written += _lines(out, "memory_vs_batch", memory, lambda row, model, _: f"{row}, {model}", "o-",
                      xlabel="physical batch size", ylabel="peak memory (GiB)", xscale="log",
                      title=f"Peak memory ({', '.join(sorted({str(k[2]) for k in memory}))})")
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
    means = {key: {t: statistics.fmean(v) for t, v in by_step.items()} for key, by_step in curves.items()}
    written += _lines(out, "metric_vs_step", means, lambda row, eps, data: f"{row}, ε={eps}, {data}", "-",
                      least=1, fontsize=7, xlabel="step", ylabel="development metric (%)",
                      title="Metric during training (mean over seeds)")
    sigmas = defaultdict(dict)
    for s in summaries:
        rc = s.get("rc_accountant")
        if rc and s.get("sigma") is not None:
            sigmas[(rc.get("d"), rc.get("estimator"), s.get("epsilon_target"))][rc["k"]] = s["sigma"]
    written += _lines(out, "sigma_vs_k", sigmas, lambda d, estimator, eps: f"{estimator}, d={d}, ε={eps}", "o-",
                      xlabel="k (probes)", ylabel="σ", xscale="log", title="DP-SGD-RC noise multiplier vs k")
    written += _excess_loss_vs_dimension(plt, out, ok)
    return written


def _lines(out: Path, name: str, series: dict, label, style: str, least=2, fontsize=8, **axes) -> list[str]:
    """A figure of one line per series ({x: y}, in order of their keys' text, labelled `label(*key)`), drawn when
    some series has `least` points."""
    if not any(len(points) >= least for points in series.values()):
        return []
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for key, points in sorted(series.items(), key=lambda kv: str(kv[0])):
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], style, label=label(*key))
    ax.set(**axes)
    ax.legend(fontsize=fontsize)
    return save_figure(fig, out, name)


MEDIAN_METRICS = (("excess_empirical_loss", "excess empirical loss"),
                  ("excess_population_loss", "excess population loss"))


def _without_problem(s: dict) -> str:
    """The run's row label less the problem's settings (A, dimension, ...): the figure's lines and axis."""
    problem = {key.split(".", 1)[1] for key in PROBLEM}
    kept = [part for part in (s.get("variant") or "").split(", ") if part and part.split("=", 1)[0] not in problem]
    return f"{s['method']} ({', '.join(kept)})" if kept else s["method"]


def _excess_loss_vs_dimension(plt, out: Path, ok: list[dict]) -> list[str]:
    """Li et al. 2022 Fig. 1: one line per A (and method, ε where several)."""
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
