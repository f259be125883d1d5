"""Broken privatizers against `dpmem audit`, as a page (docs/benchmarks/audit-variants.md; `--out` writes
elsewhere): what each audits to, beside the correct run, with gradient canaries joining the micro-batches
(audit.plant=batch, the default for dp-adam) or planted in the clipped sum (audit.plant=sum; grape, dpzero).

    OMP_NUM_THREADS=1 python scripts/audit_variants.py                        # every row below (about 30 min)
    OMP_NUM_THREADS=1 python scripts/audit_variants.py --rows vit-correct vit-a
    python scripts/audit_variants.py --canaries 5000

The variants (dpmem/audit/variants.py, which tests/test_audit.py uses too), each a mechanism the run uses in place
of the calibrated one:
- a: clip factors of 1 for the step's micro-batches (the real samples' path); the canaries planted in the sum
  clipped.
- b: noise of std σC/k on each of a step's k micro-batches instead of σC once (k = B / physical batch size
  at the expected batch size B, one more for a Poisson batch above it: the true ε is given for both).
- c: a weight used several times normed per use: ghost norms' ‖Σ_u g_u‖² taken as Σ_u ‖g_u‖² (the plan's rule).
- noise σC/2 on every tensor without a canary; the clip factor from one layer's norm; the noise skipped on one
  step; DPZero's noise σC/4.
- the noise's correlation across steps: one step's noise reused on the next (independent noise); correlated noise
  (privacy.noise=bandmf|bisr, 4 bands, train.sampling=cyclic) correct, and bandmf's broken: its buffers dropped (each
  step's noise z/c_0), its last band's coefficient halved.
ViT rows: the digits ViT at `dpmem train`'s defaults (B = 256, 337 steps, q = 0.18), dp-adam (bk); RoBERTa rows:
roberta-tiny with its MLM head (word embeddings tied to the head) on synthetic text; dpzero on the digits ViT.
ε = 2, m canaries per run. Trailing key=value arguments are dpmem overrides for every row.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from dpmem.audit import correlation_cell, run_audit, whole_noise_cell
from dpmem.audit.variants import (band_halved, buffers_dropped, clipping_from, noise_cut_away_from, noise_divided_by,
                                  noise_per_microbatch, noise_reused_on, noise_skipped_on, norms_per_use,
                                  skip_real_clipping)
from dpmem.composition import compose_points
from dpmem.privacy import epsilon_spent
from dpmem.privacy.strategies import make_strategy
from dpmem.report import benchmark_page, machine, page_header, write_markdown

ROBERTA = ("model=roberta-tiny", "model.head=mlm", "data=synthetic", "data.seq_len=32")
FC1 = "vit.layers.0.mlp.fc1.weight"  # where every batch canary lived before they were spread over the model
BANDS = 4
BANDMF = ("privacy.noise=bandmf", f"privacy.bands={BANDS}", "train.sampling=cyclic")
BISR = ("privacy.noise=bisr", f"privacy.bands={BANDS}", "train.sampling=cyclic")


# name -> (what, mechanism_of, overrides); k = 256 / physical batch size for b
ROWS = {
    "vit-correct-sum": ("correct", None, ("audit.plant=sum",)),
    "vit-correct": ("correct", None, ()),
    "vit-a": ("a: real samples unclipped", skip_real_clipping(), ()),
    "vit-b4": ("b: noise per micro-batch, k = 4", noise_per_microbatch(), ("train.physical_batch_size=64",)),
    "vit-b16": ("b: noise per micro-batch, k = 16", noise_per_microbatch(), ("train.physical_batch_size=16",)),
    "vit-cut": ("noise σ/2 on the tensors without canaries", noise_cut_away_from(), ()),
    "vit-one-layer": (f"clip factor from {FC1} alone", clipping_from(FC1), ()),
    "vit-one-layer-sum": (f"clip factor from {FC1} alone", clipping_from(FC1), ("audit.plant=sum",)),
    "vit-skip": ("noise skipped on step 200 of 337", noise_skipped_on(200), ()),
    "vit-reused": ("noise of step 200 reused on step 201", noise_reused_on(200), ()),
    "vit-bandmf": (f"correct, bandmf ({BANDS} bands)", None, BANDMF),
    "vit-bisr": (f"correct, bisr ({BANDS} bands)", None, BISR),
    "vit-bandmf-unbuffered": (f"bandmf ({BANDS} bands), its buffers dropped", buffers_dropped(), BANDMF),
    "vit-bandmf-halved": (f"bandmf ({BANDS} bands), band {BANDS - 1}'s coefficient halved", band_halved(BANDS - 1),
                          BANDMF),
    "roberta-correct": ("correct", None, ROBERTA),
    "roberta-c": ("c: tied weight normed per use", norms_per_use(), ROBERTA),
    "dpzero-correct": ("correct", None, ("method=dpzero",)),
    "dpzero-quarter": ("noise σ/4", noise_divided_by(4), ("method=dpzero",)),
}


def true_epsilon(name: str, record: dict) -> str:
    """The ε the broken run really has, where the accountant can say: b's noise is σ/√k; c lets at most √2 C
    through for RoBERTa's real samples, which use the tied weight twice; a cut noise is σ/2 or σ/4 where cut; a
    reused one leaves two releases' difference noise-free. bandmf's broken strategies are accounted as bandmf is
    (cyclic groups of at least b steps apart, so that each participation is a Gaussian of its column's norm): with
    the buffers dropped, independent noise σ/c_0 (sensitivity 1); with a coefficient c_j halved, C's columns have
    norm √(1 − 3c_j²/4) < 1. Both are more private than claimed, not the claimed mechanism."""
    run = json.loads((Path(record["run_dir"]) / "summary.json").read_text())
    correlated = {"sampling": "cyclic", "dataset_size": run["n_train"], "groups": run["groups"],
                  "noise": (run["noise"], run["bands"], run["noise_horizon"])} if run.get("groups") else {}

    def at(sigma):
        return epsilon_spent(sigma, record["delta"], record["sample_rate"], record["steps"], **correlated)
    what = ROWS[name][0]
    if what.startswith(("a:", "clip factor", "noise skipped", "noise of step")):
        return "∞"
    if correlated and "buffers dropped" in what:
        return f"{at(record['sigma'] / make_strategy('bandmf', run['bands'], run['noise_horizon']).coefs[0]):.2f}"
    if correlated and "halved" in what:
        c = make_strategy("bandmf", run["bands"], run["noise_horizon"]).coefs[-1]
        return f"{at(record['sigma'] / math.sqrt(1 - 0.75 * c ** 2)):.2f}"
    if what.startswith("b:"):  # k = B/P micro-batches at the expected batch size B, k + 1 above it
        k = round(record["batch_size"] / record["physical_batch_size"])
        return f"{at(record['sigma'] / k ** 0.5):.2f}–{at(record['sigma'] / (k + 1) ** 0.5):.2f}"
    if what.startswith("c:"):
        return f"≤ {at(record['sigma'] / 2 ** 0.5):.2f}"
    if what.startswith("noise σ/"):
        return f"{at(record['sigma'] / int(what[len('noise σ/')])):.2f}"
    return f"{record['epsilon_claimed']:.3g}"


def among(record: dict) -> str:
    """Which canaries the best guesses were among: all, or one weight's (named)."""
    if record["among"] == "all":
        return "all"
    return list(record["canaries_in"])[int(record["among"])]


def table(rows: list[tuple[str, dict]]) -> str:
    lines = ["| model | method | variant | plant | claimed ε | true ε | audited ε ≥ (95 %) | correct / guesses (among) "
             "| noise / claimed (p) | least-noised tensor, step, step pair | noise correlation (p) | flagged "
             "| time (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        noise = "—" if r["noise_ratio"] is None else f"{r['noise_ratio']:.3f} ({r['noise_p_value']:.2g})"
        flags = [w for w, f in (("bound", r["epsilon_lower_bound"] > r["epsilon_claimed"]),
                                ("noise", r["noise_flagged"]), ("whole-model noise", r["whole_noise_flagged"]),
                                ("correlation", r["correlation_flagged"])) if f]
        checks = [cell(r).removesuffix(" flagged") for cell in (whole_noise_cell, correlation_cell)]  # see `flags`
        lines.append(f"| {r['model']} | {r['method']} | {ROWS[name][0]} | {r['plant']} | {r['epsilon_claimed']:.3g} "
                     f"| {true_epsilon(name, r)} | {r['epsilon_lower_bound']:.2f} "
                     f"| {r['correct']} / {r['guesses']} ({among(r)}) | {noise} | {checks[0]} | {checks[1]} "
                     f"| {', '.join(flags) or 'no'} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--epsilon", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=Path("outputs/audit/variants"))
    ap.add_argument("--out", type=Path, default=benchmark_page(__file__, "audit-variants"))
    args, overrides = ap.parse_known_args()
    started, rows = time.time(), []
    for name in args.rows:
        _, mechanism_of, own = ROWS[name]
        point = ("method=dp-adam", f"privacy.epsilon={args.epsilon:g}", f"audit.canaries={args.canaries}",
                 "logging.progress=false", *own, *overrides)
        (cfg,) = compose_points([point])
        folder = args.dir / name
        folder.mkdir(parents=True, exist_ok=True)
        record, _ = run_audit(cfg, folder, mechanism_of=mechanism_of)
        record["batch_size"] = cfg.train.batch_size
        rows.append((name, record))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    details = (f"m = {args.canaries} gradient canaries, claimed ε = {args.epsilon:g}, rows {' '.join(args.rows)}"
               + (f", overrides {' '.join(overrides)}" if overrides else "") + ". Flagged: the bound above the claim, "
               "or a noise check (the left-out canaries', DPZero's added noise, the whole model's per tensor, per "
               "step and per step pair, or the left-out canaries' noise correlated across steps) below 10⁻⁶. The "
               "noise checks un-correlate correlated noise by the claimed strategy first.")
    write_markdown(args.out, page_header("Broken privatizers under dpmem audit", machine(), details, started)
                   + table(rows))


if __name__ == "__main__":
    main()
