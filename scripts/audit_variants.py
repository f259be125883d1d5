"""Issue 42's three broken privatizers against `dpmem audit`, as a markdown table: what each audits to with gradient
canaries planted in the clipped sum (audit.plant=sum, the default before) and joining the micro-batches
(audit.plant=batch, the default now for dp-adam, dp-sgd, galore-dp-naive and dp-sgd-rc), beside the correct run.

    python scripts/audit_variants.py                            # all rows below (about 12 audits)
    python scripts/audit_variants.py --rows vit-correct vit-a   # some of them
    python scripts/audit_variants.py --canaries 5000

The variants, each a substitution into the real code (dpmem/audit/variants.py, which tests/test_audit.py uses too):
- a: clipping skipped on the real samples' path only (one pass: the micro-batch's weighted sum takes weight 1;
  two passes: every norm 0); the Privatizer's `clipped_sum_of`, which clips canaries planted in the sum, unchanged.
- b: noise of std σC/k added to each of a step's k micro-batches instead of σC once (k = B / physical batch size
  at the expected batch size B, one more for a Poisson batch above it: the true ε is given for both).
- c: a weight used several times normed per use: ghost norms' ‖Σ_u g_u‖² taken as Σ_u ‖g_u‖².
ViT rows: the digits ViT at `dpmem train`'s defaults (B = 256, 337 steps, q = 0.18), dp-adam (bk); RoBERTa rows:
roberta-tiny with its MLM head (word embeddings tied to the head) on synthetic text. ε = 2, m canaries per run.
Trailing key=value arguments are dpmem overrides for every row. The table lands in outputs/audit/variants.md.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch

from dpmem.audit import run_audit
from dpmem.audit.variants import noise_per_microbatch, norms_per_use, skip_real_clipping
from dpmem.cli import compose_points
from dpmem.privacy import epsilon_spent
from dpmem.report import write_markdown

ROBERTA = ("model=roberta-tiny", "model.head=mlm", "data=synthetic", "data.seq_len=32")


# name -> (what, variant, overrides); k = 256 / physical batch size for b
ROWS = {
    "vit-correct-sum": ("correct", contextlib.nullcontext, ("audit.plant=sum",)),
    "vit-correct": ("correct", contextlib.nullcontext, ()),
    "vit-a-sum": ("a: real samples unclipped", skip_real_clipping, ("audit.plant=sum",)),
    "vit-a": ("a: real samples unclipped", skip_real_clipping, ()),
    "vit-b4-sum": ("b: noise per micro-batch, k = 4", noise_per_microbatch,
                   ("train.physical_batch_size=64", "audit.plant=sum")),
    "vit-b4": ("b: noise per micro-batch, k = 4", noise_per_microbatch, ("train.physical_batch_size=64",)),
    "vit-b8": ("b: noise per micro-batch, k = 8", noise_per_microbatch, ("train.physical_batch_size=32",)),
    "vit-b16": ("b: noise per micro-batch, k = 16", noise_per_microbatch, ("train.physical_batch_size=16",)),
    "roberta-correct-sum": ("correct", contextlib.nullcontext, (*ROBERTA, "audit.plant=sum")),
    "roberta-correct": ("correct", contextlib.nullcontext, ROBERTA),
    "roberta-c-sum": ("c: tied weight normed per use", norms_per_use, (*ROBERTA, "audit.plant=sum")),
    "roberta-c": ("c: tied weight normed per use", norms_per_use, ROBERTA),
}


def true_epsilon(variant, record: dict) -> str:
    """The ε the broken run really has, where the accountant can say: b's noise is σ/√k; c lets at most √2 C
    through for RoBERTa's real samples, which use the tied weight twice."""
    def at(sigma):
        return epsilon_spent(sigma, record["delta"], record["sample_rate"], record["steps"])
    if variant is skip_real_clipping:
        return "∞"
    if variant is noise_per_microbatch:  # k = B/P micro-batches at the expected batch size B, k + 1 above it
        k = round(record["batch_size"] / record["physical_batch_size"])
        return f"{at(record['sigma'] / k ** 0.5):.2f}–{at(record['sigma'] / (k + 1) ** 0.5):.2f}"
    if variant is norms_per_use:
        return f"≤ {at(record['sigma'] / 2 ** 0.5):.2f}"
    return f"{record['epsilon_claimed']:.3g}"


def table(rows: list[tuple[str, dict]]) -> str:
    lines = ["| model | variant | plant | claimed ε | true ε | audited ε ≥ (95 %) | correct / guesses "
             "| noise / claimed (p) | flagged | time (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        what, variant, _ = ROWS[name]
        noise = "—" if r["noise_ratio"] is None else f"{r['noise_ratio']:.3f} ({r['noise_p_value']:.2g})"
        flags = [w for w, f in (("bound", r["epsilon_lower_bound"] > r["epsilon_claimed"]),
                                ("noise", r["noise_flagged"])) if f]
        lines.append(f"| {r['model']} | {what} | {r['plant']} | {r['epsilon_claimed']:.3g} "
                     f"| {true_epsilon(variant, r)} "
                     f"| {r['epsilon_lower_bound']:.2f} | {r['correct']} / {r['guesses']} | {noise} "
                     f"| {', '.join(flags) or 'no'} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--epsilon", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=Path("outputs/audit/variants"))
    ap.add_argument("--out", type=Path, default=Path("outputs/audit/variants.md"))
    args, overrides = ap.parse_known_args()
    start, rows = time.time(), []
    for name in args.rows:
        _, variant, own = ROWS[name]
        point = ("method=dp-adam", f"privacy.epsilon={args.epsilon:g}", f"audit.canaries={args.canaries}",
                 "logging.progress=false", *own, *overrides)
        (cfg,) = compose_points([point])
        folder = args.dir / name
        folder.mkdir(parents=True, exist_ok=True)
        with variant():
            record, _ = run_audit(cfg, folder)
        record["batch_size"] = cfg.train.batch_size
        rows.append((name, record))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = (f"# Issue 42's broken privatizers under dpmem audit\n\n`python scripts/audit_variants.py "
            f"{' '.join(overrides)}`: m = {args.canaries} gradient canaries, claimed ε = {args.epsilon:g}, "
            f"{torch.get_num_threads()} threads, total {time.time() - start:.0f} s.\n\n" + table(rows))
    write_markdown(args.out, text)


if __name__ == "__main__":
    main()
