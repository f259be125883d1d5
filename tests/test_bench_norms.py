"""scripts/bench_norms.py runs and writes its tables, and its measured memory and FLOP formulas obey the paper's
(DP-SGD-RC Tables 6 and 8) bounds."""

import importlib.util
from pathlib import Path

import pytest

from helpers import run_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_norms.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_norms", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load()


def _sections(text: str) -> dict[str, str]:
    return {part.split("\n", 1)[0]: part for part in text.split("\n### ")[1:]}


def _table(section: str) -> tuple[list[str], list[list[str]]]:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---")]
    return rows[0], rows[1:]


def _find(sections, prefix):
    (name,) = [n for n in sections if n.startswith(prefix)]
    return _table(sections[name])


def test_script_writes_memory_flops_time_tables(tmp_path):
    out = tmp_path / "norms.md"
    r = run_script(SCRIPT.name, "--shapes", "64x32", "--tokens", "16", "--ks", "2", "4", "128", "--cpu-tokens", "8",
                   "--cpu-ks", "2", "--repeats", "1", "--out", str(out), env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "### Peak memory" in r.stdout
    sections = _sections(text)
    estimators = {("hutch", "2"), ("hutchpp", "2"), ("hutch", "4"), ("hutchpp", "4")}  # k = 128 > n = 64: skipped
    exact = {("fgc", "-"), ("ghost", "-"), ("mixed (→ghost)", "-")}  # 2T² = 512 < p·d = 2048

    header, rows = _find(sections, "Peak memory")
    assert "red. vs FGC w/o inputs %" in header and "red. vs mixed %" in header
    assert all(len(row) == len(header) and row[0] == "64x32" for row in rows)
    assert {(row[2], row[3]) for row in rows} == exact | estimators and len(rows) == 7
    assert "64x32: k = 128" in sections[[n for n in sections if n.startswith("Peak memory")][0]]
    fgc_row = next(row for row in rows if row[2] == "fgc")
    assert float(fgc_row[header.index("red. vs FGC %")]) == 0.0

    header, rows = _find(sections, "FLOPs")
    assert {(row[1], row[2]) for row in rows} == exact | estimators
    col = header.index("GFLOP (formula)")
    fgc = next(float(row[col]) for row in rows if row[1] == "fgc")
    assert fgc == pytest.approx(2 * 64 * 32 * (2 * 16 - 1) / 1e9, rel=1e-3)

    header, rows = _find(sections, "CPU wall time")
    assert {(row[1], row[2]) for row in rows} == exact | {("hutch", "2"), ("hutchpp", "2")}
    assert all(float(row[header.index("median (ms)")]) > 0 for row in rows)

    header, rows = _find(sections, "Projection side")
    assert rows and all(row[-1] == "yes" for row in rows)
    header, rows = _find(sections, "Meta peak vs CPU peak")
    assert rows and all(row[-1] == "yes" for row in rows)


def test_measured_meta_peaks_obey_table6_bounds():
    B, T, p, d, f32 = 2, 16, 64, 32, 4
    extra = {rule: bench.measure_memory(p, d, T, B, rule, k=2)["extra"] for rule in ("fgc", "ghost", "hutch")}
    assert extra["fgc"] >= B * p * d * f32  # the (B, p, d) per-sample gradients exist at once
    assert extra["ghost"] >= 2 * B * T * T * f32  # two (B, T, T) Gram matrices
    assert extra["hutch"] < min(extra["fgc"], extra["ghost"], B * p * d * f32, 2 * B * T * T * f32)
    # Table 6's Bk(T + d) + pk, up to transients of the same order as its small terms (unscaled probes, the
    # squared (B, d, k) sketch, the output)
    assert extra["hutch"] <= bench.table6_extra("hutch", p, d, T, B, 2) + f32 * (p * 2 + B * d * 2) + 8 * B
    # projecting the larger side either way round: the transposed layer costs the same
    assert bench.measure_memory(d, p, T, B, "hutch", k=2)["extra"] == extra["hutch"]


def test_meta_peak_equals_cpu_peak():
    rows = bench.validate_meta_vs_cpu(p=40, d=24, T=10, B=3, k=3)
    assert len(rows) == 10 and all(r["meta"] == r["cpu"] > 0 for r in rows)


@pytest.mark.parametrize("p,d,T,B", [(64, 32, 16, 2), (8192, 2048, 4096, 2), (512, 2048, 100, 3)])
def test_flop_formulas_match_table8(p, d, T, B):
    assert bench.flops("fgc", p, d, T, B) == B * p * d * (2 * T - 1)
    assert bench.flops("ghost", p, d, T, B) == 2 * B * T * T * (p + d) - B
    k, n, m = 8, max(p, d), min(p, d)
    # Table 8's RC exact count (with p, d read as the projected and the other side) plus the probe scaling
    assert bench.flops("hutch", p, d, T, B, k) == 2 * B * T * k * (p + d) + B * k * (m - T) - B + n * k
    assert bench.flops("hutchpp", p, d, T, B, k) > 4 * bench.flops("hutch", p, d, T, B, k) - 4 * n * k


def test_flop_formulas_agree_with_torch_matmul_count():
    p, d, T, B, k = 256, 64, 128, 2, 4
    for rule in ("fgc", "ghost", "mixed", "hutch", "hutchpp"):
        ours, torch_count = bench.flops(rule, p, d, T, B, k), bench.torch_matmul_flops(p, d, T, B, rule, k)
        assert ours == pytest.approx(torch_count, rel=0.05), rule
    assert bench.flops("fgc", p, d, T, B) == bench.torch_matmul_flops(p, d, T, B, "fgc") - B * p * d
