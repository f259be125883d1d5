"""Noise multipliers of DP-SGD-RC against probes k and layer size d, and the envelope threshold x₊, as markdown.

    python scripts/rc_sigma.py          # docs/benchmarks/rc-sigma.md, sigma_vs_k and sigma_vs_d .png/.pdf (about 4 min)

The setting is Table 4 (BBC) of DP-SGD-RC (Efficient DP-SGD for LLMs with Randomized Clipping): delta = 1e-5, batch 64,
10 epochs, Poisson rate q = 64/N, round(10 N/64) steps, with N = 1127, where the DP-SGD (pld) noise multiplier is the
paper's 4.073. Tables: sigma against k at d = 2048 (eps 0.7, the paper's Fig. 11b), sigma against d at k = 32 (eps 2 and
9, its Fig. 12; and d = inf), and x₊ for k = 1..32, d = 2..2048 with (x₊ - 1)·dk (its Fig. 7 reports ≈ 2 everywhere).
Small k need large sigma: their sensitivity 1/√Y has a heavy lower tail of Y (k = 1: P(Y ≤ y) ~ √y) that only noise can
cover.

The page is headed by the command, device, torch version and date; the figures are written beside it and shown in it.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from dpmem.privacy import UnreachableTarget, calibrate_sigma, x_plus
from dpmem.report import benchmark_page, machine, page_header, pyplot, save_figure, write_markdown

N, DELTA, EPOCHS, BATCH = 1127, 1e-5, 10, 64
Q, STEPS = BATCH / N, round(EPOCHS * N / BATCH)
TOL = 1e-4


def sigma(epsilon: float, **rc) -> float | None:
    try:
        if not rc:
            return calibrate_sigma(epsilon, DELTA, Q, STEPS, "pld", tolerance=TOL)
        return calibrate_sigma(epsilon, DELTA, Q, STEPS, "rc", tolerance=TOL, **rc)
    except UnreachableTarget:
        return None


def fmt(s: float | None) -> str:
    return "unreachable" if s is None else f"{s:.4g}"


def ratio(s: float | None, base: float) -> str:
    return "" if s is None else f"{s / base:.4f}"


def k_table(lines: list[str], ks: list[int]) -> dict:
    base = sigma(0.7)
    series = {"Hutch": [], "Hutch++": [], "DP-SGD": base}
    lines += [f"## σ against k (ε = 0.7, d = 2048; DP-SGD σ = {base:.4f}; paper Fig. 11b, Table 4: 4.073 / 4.354)", "",
              "| k | Hutch σ | Hutch++ σ | Hutch / DP-SGD | Hutch++ / DP-SGD |", "|---|---|---|---|---|"]
    for k in ks:
        h, hpp = sigma(0.7, k=k, d=2048), sigma(0.7, k=k, d=2048, estimator="hutchpp")
        lines.append(f"| {k} | {fmt(h)} | {fmt(hpp)} | {ratio(h, base)} | {ratio(hpp, base)} |")
        print(lines[-1], flush=True)
        series["Hutch"].append((k, h))
        series["Hutch++"].append((k, hpp))
    lines.append("")
    return series


def d_table(lines: list[str], ds: list[int], epsilons: list[float]) -> dict:
    head = " | ".join(f"ε = {e:g} Hutch | ε = {e:g} Hutch++" for e in epsilons)
    base = " ; ".join(f"ε = {e:g}: {sigma(e):.4f}" for e in epsilons)
    lines += [f"## σ against d (k = 32; DP-SGD σ {base}; DP-SGD-RC Fig. 12)", "", f"| d | {head} |",
              "|---|" + "---|" * 2 * len(epsilons)]
    series = {(e, est): [] for e in epsilons for est in ("Hutch", "Hutch++")}
    for d in ds:
        values = {(e, est): sigma(e, k=32, d=d, **({"estimator": "hutchpp"} if est == "Hutch++" else {}))
                  for e, est in series}
        for key, v in values.items():
            series[key].append((d, v))
        cells = " | ".join(f"{fmt(values[(e, 'Hutch')])} | {fmt(values[(e, 'Hutch++')])}" for e in epsilons)
        lines.append(f"| {d} | {cells} |")
        print(lines[-1], flush=True)
    # d = inf: dpmem's whole-model envelope, the same for both estimators (dpmem.methods.rc.rc_dimension)
    lines.append("| ∞ (dpmem's whole-model d) | " + " | ".join(f"{fmt(s)} | {fmt(s)}" for s in
                                                         (sigma(e, k=32, d=math.inf) for e in epsilons)) + " |")
    print(lines[-1], flush=True)
    lines.append("")
    return series


def figures(out: Path, by_k: dict, by_d: dict) -> list[Path]:
    """σ against k (DP-SGD-RC paper Fig. 11b) and against d (its Fig. 12), PNG and PDF beside the markdown."""
    plt, written = pyplot(), []
    for name, title, xlabel, lines in (
            ("sigma_vs_k", "σ against k (ε = 0.7, d = 2048)", "k (probes)",
             {est: by_k[est] for est in ("Hutch", "Hutch++")}),
            ("sigma_vs_d", "σ against d (k = 32)", "d", {f"{est}, ε = {e:g}": v for (e, est), v in by_d.items()})):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, points in lines.items():
            points = [(x, y) for x, y in points if y is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], "o-", label=label)
        if name == "sigma_vs_k":
            ax.axhline(by_k["DP-SGD"], linestyle="--", color="gray", label="DP-SGD")
            ax.set_yscale("log")  # σ spans 4 to 3e5 over k: on a linear axis every k > 2 lies on DP-SGD's line
        ax.set(xscale="log", xlabel=xlabel, ylabel="σ", title=title)
        ax.legend(fontsize=8)
        written += [out.parent / n for n in save_figure(fig, out.parent, name)]
    return written


def x_plus_table(lines: list[str], ks: list[int], ds: list[int]) -> None:
    lines += ["## x₊ and (x₊ - 1)·dk (DP-SGD-RC Fig. 7: ≈ 2 within 0.5%)", "",
              "| d | " + " | ".join(f"k = {k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for d in ds:
        cells = []
        for k in ks:
            xp = x_plus(k, d)
            cells.append(f"{xp:.6g} ({(xp - 1) * d * k:.3f})")
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines.append("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=benchmark_page(__file__, "rc-sigma"),
                        help="the page to write, the figures beside it (default: docs/benchmarks/rc-sigma.md)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--ds", type=int, nargs="+", default=[1, 2, 8, 32, 128, 512, 2048, 8192, 65536])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 9.0])
    parser.add_argument("--xplus-ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--xplus-ds", type=int, nargs="+", default=[2 ** i for i in range(1, 12)])
    args = parser.parse_args()
    start = time.time()
    lines = []
    by_k = k_table(lines, args.ks)
    by_d = d_table(lines, args.ds, args.epsilons)
    x_plus_table(lines, args.xplus_ks, args.xplus_ds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = figures(args.out, by_k, by_d)
    k_png, d_png = (p.name for p in written if p.suffix == ".png")  # DP-SGD-RC Figs. 11b and 12
    lines += [f"![σ against k]({k_png})", "", f"![σ against d]({d_png})", ""]
    details = (f"Setting: δ = {DELTA:g}, batch {BATCH}, {EPOCHS} epochs, N = {N}, Poisson rate q = {Q:.6f}, "
               f"{STEPS} steps, add/remove; σ calibrated to tolerance {TOL:g}, relative above σ = 1 "
               "(calibrate_sigma, accountant rc: revealed random sensitivity, connect-the-dots PLD, lower-edge bins).")
    header = page_header("DP-SGD-RC noise multipliers", machine(), details, start)
    write_markdown(args.out, header + "\n".join(lines))
    print(f"wrote {args.out}, {', '.join(p.name for p in written)}")


if __name__ == "__main__":
    main()
