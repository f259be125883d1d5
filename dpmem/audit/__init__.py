"""`dpmem audit`: train one run with m canaries, each in the training set with probability ½, score them, and turn
the scores into an empirical lower bound on epsilon (one-run auditing: Steinke, Nasr, Jagielski, NeurIPS 2023,
arXiv 2305.08846). A bound above the run's claimed epsilon proves the run is not as private as claimed; a bound
below it is what a correct method gives (a one-run audit of the Gaussian mechanism reaches about half of the
true epsilon at m = 10⁵ canaries: tests/test_audit.py)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from dpmem.audit.bound import audit_bound
from dpmem.audit.canaries import GradientCanaries, InputCanaries
from dpmem.config import ConfigError, enum_value
from dpmem.engine.summary import json_ready
from dpmem.engine.trainer import Run
from dpmem.methods import method_class


def run_audit(cfg, out: Path) -> tuple[dict, str]:
    """Train `cfg` with canaries into out/run, write out/audit.json, audit.md and the scores figure."""
    a, name = cfg.audit, cfg.method.name
    if not method_class(name).private:
        raise ConfigError("method.name", f"{name} is not private: there is no claimed epsilon to audit")
    if cfg.privacy.epsilon is None:
        raise ConfigError("privacy", "privacy=none claims no epsilon to audit; choose a budget, e.g. privacy=eps2")
    if not 0 < a.beta < 1:
        raise ConfigError("audit.beta", f"{a.beta} must be in (0, 1)")
    if a.canaries < 2:
        raise ConfigError("audit.canaries", f"{a.canaries}: need at least 2")
    if cfg.train.checkpoint_every or (out / "run" / "checkpoint.pt").exists():
        # the canaries' scores live in this process: a resumed run would score only the steps after the crash
        raise ConfigError("train.checkpoint_every", "dpmem audit does not resume; run it without checkpoints, "
                          "into a fresh audit.dir")
    kind = enum_value(a.kind)
    start = time.perf_counter()
    # gradient canaries join the method's privatised quantity (the Privatizer's clipped sums, DPZero's scalars);
    # input canaries its training set
    inputs = InputCanaries(a.canaries, a.seed) if kind == "input" else None
    canaries = inputs or GradientCanaries(a.canaries, a.norm * cfg.method.max_grad_norm, a.seed)
    (out / "run").mkdir(parents=True, exist_ok=True)
    run = Run(cfg, out / "run", data_hook=inputs.plant if inputs else None,
              observers=() if inputs else (canaries,))
    parts = run.prepare()
    summary = run.execute()
    if summary["status"] != "ok":
        raise RuntimeError(f"the audited run ended {summary['status']}: {summary['error']}")
    if inputs is not None:
        inputs.score(parts, batch=max(1, cfg.train.physical_batch_size or cfg.train.batch_size))
    ledger = parts.ledger
    bound = audit_bound(canaries.scores.numpy(), canaries.included.numpy(), delta=ledger.delta, beta=a.beta)
    record = {"method": name, "clipping": summary["clipping"], "model": cfg.model.name, "data": cfg.data.name,
              "kind": kind, "epsilon_claimed": summary["epsilon_spent"], "delta": ledger.delta,
              "sigma": summary["sigma"], "steps": summary["steps_done"], "sample_rate": ledger.sample_rate,
              **bound, "confidence": 1 - a.beta, "seconds": time.perf_counter() - start,
              "scores": canaries.scores.tolist(), "in": canaries.included.tolist(), "run_dir": str(out / "run")}
    (out / "audit.json").write_text(json.dumps(json_ready(record), indent=1) + "\n")
    text = table([record])
    (out / "audit.md").write_text(text)
    figure(out, record)
    return record, text


def table(records: list[dict]) -> str:
    confidence = " / ".join(sorted({f"{r['confidence']:.0%}" for r in records}))
    lines = [f"| method | clipping | canary kind | m | claimed ε | δ | audited ε ≥ ({confidence}) | k | correct / guesses "
             "| time (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['method']} | {r['clipping'] or '—'} | {r['kind']} | {r['canaries']} "
                     f"| {r['epsilon_claimed']:.3g} | {r['delta']:.2g} | {r['epsilon_lower_bound']:.3f} | {r['k']} "
                     f"| {r['correct']} / {r['guesses']} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def figure(out: Path, record: dict) -> None:
    from dpmem.report import pyplot, save_figure

    plt = pyplot()
    scores, included = torch.tensor(record["scores"]), torch.tensor(record["in"])
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = torch.linspace(float(scores.min()), float(scores.max()) + 1e-12, 41).tolist()
    ax.hist(scores[included].tolist(), bins=bins, alpha=0.6, label="in")
    ax.hist(scores[~included].tolist(), bins=bins, alpha=0.6, label="out")
    eps = record["epsilon_claimed"]
    ax.set(xlabel="canary score", ylabel="canaries", title=f"{record['method']}: claimed ε = "
           f"{eps if math.isinf(eps) else round(eps, 3)}, audited ε ≥ {record['epsilon_lower_bound']:.3f}")
    ax.legend()
    save_figure(fig, out, "scores")
