"""The run folder's records: metrics.jsonl lines, privacy.jsonl (append-only: ε spent), summary.json (rewritten
atomically, so a run that dies leaves a readable one) and the short table printed at the end."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from pathlib import Path

import torch

import dpmem


def versions() -> dict:
    try:
        import transformers
        tf = transformers.__version__
    except ImportError:  # pragma: no cover
        tf = None
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(dpmem.__file__).parent,
                             capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {"dpmem": dpmem.__version__, "git": rev, "torch": torch.__version__, "transformers": tf,
            "python": platform.python_version()}


def json_ready(value):
    """JSON has no inf or nan: an infinite value (ε of a run that is not private, the rc envelope's d) is written
    "inf" (float("inf") reads it back), nan null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def write_summary(run_dir: Path, summary: dict) -> None:
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(json_ready(summary), indent=2) + "\n")
    os.replace(tmp, run_dir / "summary.json")


def append_metrics(run_dir: Path, record: dict) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(json_ready(record)) + "\n")


PRIVACY_LEDGER = "privacy.jsonl"


def append_privacy(run_dir: Path, record: dict) -> None:
    """One line of the run folder's append-only record of ε spent, on disk before the step after it runs. No dpmem
    command truncates or rewrites it: a run started again in the folder (resumed or overwritten) adds its own."""
    with open(run_dir / PRIVACY_LEDGER, "a") as f:
        f.write(json.dumps(json_ready(record)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def privacy_records(run_dir: Path) -> list[dict]:
    """The ledger's lines (a line cut short by a crash is skipped)."""
    path = Path(run_dir) / PRIVACY_LEDGER
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def most_spent(records: list[dict]) -> float | None:
    """The largest ε any line records: what was released, whatever happened after."""
    spent = [float(r["epsilon"]) for r in records if r.get("epsilon") is not None]
    return max(spent) if spent else None


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "inf"
        return f"{value:.4g}"
    return str(value)


def summary_table(s: dict) -> str:
    mem = s.get("peak_memory_bytes")
    rows = [
        ("status", s.get("status")),
        ("method / model / data", f"{s.get('method')} / {s.get('model')} / {s.get('data')}"),
        ("steps done / planned", f"{s.get('steps_done')} / {s.get('steps')}"),
        ("epsilon spent / target", f"{_fmt(s.get('epsilon_spent'))} / {_fmt(s.get('epsilon_target'))}"
                                   f" (delta {_fmt(s.get('delta'))}, sigma {_fmt(s.get('sigma'))})"),
        (f"{s.get('metric_name')} final / best", f"{_fmt(s.get('metric_final'))} / {_fmt(s.get('metric_best'))}"),
        ("peak memory", f"{mem / 2**20:.1f} MiB ({s.get('peak_memory_source')})" if mem else "-"),
        ("throughput", f"{_fmt(s.get('throughput_samples_per_s'))} samples/s"),
        ("wall time", f"{_fmt(s.get('wall_time_s'))} s"),
        ("run folder", s.get("run_dir")),
    ]
    if s.get("error"):
        rows.append(("error", s["error"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
