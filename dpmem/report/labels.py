"""Row labels, shared by the report's tables (`dpmem.report.runs`) and figures (`dpmem.report.figures`): a run's
method and the settings that tell it from the method's other runs on the same data set."""

from __future__ import annotations

import json
from collections import defaultdict

from dpmem.engine.folder import NOT_FINGERPRINTED

# settings of how a run is started and recorded, not what it trains (also what two repeats of a run may differ in)
NOT_TRAINING = (*(f"train.{key}" for key in NOT_FINGERPRINTED), "train.eval_batch_size", "logging.", "memory.",
                "spectrum.", "audit.", "debug")
# what is averaged over (seeds) or is a row or column already, so never tells two variants apart
NOT_A_VARIANT = (*NOT_TRAINING, "train.seed", "data.fewshot_seed", "privacy.", "data.", "method.name",
                 "model.arch.", "model.family", "model.pretrained", "model.tokenizer")  # model.name says these


# a generated problem's settings (data=median) are what its runs compare, though they are data options
PROBLEM = ("data.A", "data.dimension", "data.d_min", "data.alpha")
USER = " (per user)"  # a user-level ε's mark (privacy.unit=user), wherever it is shown beside record-level ones


def epsilon_number(eps: str) -> float:
    """The ε a row's ε label starts with: "2.27 (σ 0.8) (per user)" (a fixed σ's, user-level) -> 2.27."""
    return float(eps.split(" ")[0])
# how the noise is correlated, though a privacy option: independent and bandmf runs are a row each, never averaged
STRATEGY = ("privacy.noise", "privacy.bands")


def variants(summaries: list[dict]) -> None:
    """Label each summary with the settings that differ between runs of its method on its data set (e.g.
    method.subspace.k=10), so a sweep over them gives one row each; seeds, the row's ε and the column's data set
    are not settings here."""
    by_method = defaultdict(list)
    for s in summaries:
        by_method[(s["method"], s["data"])].append(s)
    for runs in by_method.values():
        keys = set().union(*(r["config"] for r in runs))
        varying = sorted(k for k in keys if (k in PROBLEM + STRATEGY or not k.startswith(NOT_A_VARIANT))
                         and len({json.dumps(r["config"].get(k), sort_keys=True) for r in runs}) > 1)
        for r in runs:
            r["variant"] = ", ".join(f"{k.split('.', 1)[-1]}={r['config'].get(k)}" for k in varying)


def row_label(s: dict) -> str:
    """The table row a run belongs to: its method, and the settings that tell it from the method's other runs."""
    return f"{s['method']} ({s['variant']})" if s.get("variant") else s["method"]


def file_name(label: str) -> str:
    """A label ("method=grape privacy=eps2") as a file or folder name: other characters than letters, digits and
    -_.= become _."""
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label)
