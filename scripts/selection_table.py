"""The cost of choosing hyperparameters privately, computed by dpmem (dpmem.privacy.selection, dp-accounting's RDP
accountant), as a markdown page: for one run's noise, the ε of releasing one run, the best of `mean` runs composed,
and a private selection under each law of K (Papernot & Steinke 2022); then, for a budget, each law's noise
multiplier per trial.

    python scripts/selection_table.py       # the default run (digits): 337 steps, q = 256/1437, δ = 1e-5, mean 10

Writes docs/benchmarks/selection.md (`--out` writes elsewhere)."""

from __future__ import annotations

import argparse
import time

import dp_accounting
from dp_accounting import rdp

from dpmem.privacy import calibrate_sigma
from dpmem.privacy.accounting import _event
from dpmem.privacy.selection import POISSON, calibrate_selection, law, selection_epsilon
from dpmem.report import benchmark_page, machine, page_header, write_markdown

SHAPES = (0.0, 0.5, 1.0, 3.0, POISSON)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the default `dpmem train`: 60 epochs of Poisson batches of 256 from digits' 1,437 training images
    ap.add_argument("--steps", type=int, default=337)
    ap.add_argument("--rate", type=float, default=256 / 1437)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--mean", type=float, default=10.0)
    ap.add_argument("--run-epsilon", type=float, default=2.0, help="one run's ε (PLD), which sets σ")
    ap.add_argument("--budget", type=float, default=4.0, help="the whole search's ε, for the second table")
    ap.add_argument("--out", default=benchmark_page(__file__, "selection"))
    args = ap.parse_args()
    started = time.time()
    sigma = calibrate_sigma(args.run_epsilon, args.delta, args.rate, args.steps)
    run = _event(sigma, args.rate, args.steps, "poisson", None)
    eps = lambda event: rdp.RdpAccountant().compose(event).get_epsilon(args.delta)  # noqa: E731
    lines = [f"### One run's noise (σ = {sigma:.4g}, ε = {args.run_epsilon:g} by PLD), mean {args.mean:g} trials", "",
             "| release | ε (RDP) |", "|---|---|", f"| one run | {eps(run):.3g} |",
             f"| the best of {args.mean:g} runs, every run composed | "
             f"{eps(dp_accounting.ComposedDpEvent([run] * round(args.mean))):.3g} |"]
    lines += [f"| private selection, {law(s)} | "
              f"{selection_epsilon(sigma, args.delta, args.rate, args.steps, args.mean, s):.3g} |" for s in SHAPES]
    lines += ["", f"### A budget of ε = {args.budget:g} for the whole search: each trial's noise", "",
              "| search | σ per trial | one trial's ε alone (RDP) |", "|---|---|---|"]
    alone = calibrate_sigma(args.budget, args.delta, args.rate, args.steps, accountant="rdp")
    lines.append(f"| one run (no search) | {alone:.4g} | {args.budget:g} |")
    for s in SHAPES:
        trial = calibrate_selection(args.budget, args.delta, args.rate, args.steps, args.mean, s)
        one = eps(_event(trial, args.rate, args.steps, "poisson", None))
        lines.append(f"| private selection, {law(s)} | {trial:.4g} | {one:.3g} |")
    details = (f"{args.steps} steps of Poisson rate {args.rate:.4g}, δ = {args.delta:g}, K of mean {args.mean:g}; "
               "dp-accounting's RepeatAndSelectDpEvent under its RDP accountant.")
    write_markdown(args.out, page_header("What choosing hyperparameters privately costs", machine(), details, started)
                   + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
