"""The benchmark scripts run and write their tables (numbers are claimed by running them, not here)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_methods_writes_a_row_per_method_and_batch(tmp_path):
    out = tmp_path / "methods.md"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_methods.py"), "--batch-sizes", "2", "4",
                        "--steps", "1", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 2 ") or line.startswith("| 4 ")]
    methods = {"adam", "galore", "mezo", "dp-adam", "galore-dp-naive", "grape", "dpzero"}
    assert len(rows) == 2 * len(methods) and {row.split("|")[2].strip() for row in rows} == methods
