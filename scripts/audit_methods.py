"""Claimed epsilon against the one-run audit's lower bound, for every private method, as a markdown table.

    python scripts/audit_methods.py                       # the digits ViT (dpmem train's default), eps 2 and 8
    python scripts/audit_methods.py --canaries 2000 --epsilons 8 train.batch_size=256

Each (method, epsilon) is one `dpmem audit` run (gradient canaries, dpmem.audit) in outputs/audit/methods/; trailing
key=value arguments are dpmem overrides for all of them. The table lands in outputs/audit/methods.md (and is printed).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dpmem.audit import run_audit, table
from dpmem.composition import compose_points
from dpmem.report import write_markdown

METHODS = ["dp-adam", "dp-sgd", "grape", "galore-dp-naive", "dp-sgd-rc", "dpzero"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--epsilons", nargs="+", type=float, default=[2.0, 8.0])
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--dir", type=Path, default=Path("outputs/audit/methods"))
    ap.add_argument("--out", type=Path, default=Path("outputs/audit/methods.md"))
    args, overrides = ap.parse_known_args()
    start, records = time.time(), []
    for eps in args.epsilons:
        for method in args.methods:
            point = (f"method={method}", f"privacy.epsilon={eps:g}", f"audit.canaries={args.canaries}",
                     "logging.progress=false", *overrides)
            (cfg,) = compose_points([point])
            folder = args.dir / f"{method}_eps{eps:g}"
            folder.mkdir(parents=True, exist_ok=True)
            record, _ = run_audit(cfg, folder)
            records.append(record)
            print(table([record]).splitlines()[-1], flush=True)
    text = (f"# One-run audits (gradient canaries, 95 % confidence)\n\nOverrides: {' '.join(overrides) or 'none'}; "
            f"{args.canaries} canaries per run; total {time.time() - start:.0f} s.\n\n" + table(records))
    write_markdown(args.out, text)


if __name__ == "__main__":
    main()
