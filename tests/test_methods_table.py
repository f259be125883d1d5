"""The one table of methods (scripts/methods_table.py, docs/benchmarks/methods-table.md): the script plans and writes
it, a figure missing from a cited page stops it, and the committed page's cited cells are still the cited pages'."""

import importlib.util
import sys
from pathlib import Path

import pytest

from dpmem.report.pages import Page
from helpers import run_script

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks" / "methods-table.md"


def script():
    spec = importlib.util.spec_from_file_location("methods_table", ROOT / "scripts" / "methods_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["methods_table"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.long
def test_methods_table_plans_every_method_and_draws_its_plot(tmp_path):
    out = tmp_path / "methods-table.md"
    r = run_script("methods_table.py", "--model", "roberta-tiny", "--batch-size", "2", "--seq-len", "8", "--out",
                   str(out), env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    page = Page(out)
    methods = [row.method for row in script().ROWS]
    assert [r["method"] for r in page.tables[0].rows] == methods
    assert all(float(r["planned peak (GiB)"]) >= 0 for r in page.tables[0].rows)
    assert (tmp_path / "methods-table.png").stat().st_size > 10_000
    assert "![" in out.read_text() and "methods-table.png" in out.read_text()


def test_a_figure_missing_from_a_cited_page_stops_the_table(monkeypatch):
    module = script()
    monkeypatch.setattr(module, "GPU_BATCH", "33")  # no row of peers-cuda-tf32.md has B = 33
    with pytest.raises(LookupError, match="peers-cuda-tf32.md"):
        module.cite()


def test_the_committed_table_still_quotes_its_pages():
    """Each cited cell of docs/benchmarks/methods-table.md is what the script reads from the cited page today: a
    cited page rerun (or edited) without rerunning scripts/methods_table.py fails here."""
    module = script()
    cited, sources, _ = module.cite()
    rows = {r["method"]: r for r in Page(PAGE).tables[0].rows}
    assert list(rows) == [row.method for row in module.ROWS]
    for method, cells in cited.items():
        row = rows[method]
        assert row["GPU samples/s, eager"] == cells.get("gpu", (None, "none"))[1], method
        assert row["GPU samples/s, compiled"] == cells.get("compiled", (None, "-"))[1], method
        assert row["no GPU figure: CPU samples/s"] == cells.get("cpu", "-" if "gpu" in cells else "none"), method
        assert row["accuracy at ε = 8"] == cells["accuracy"], method
    listed = {r["key"]: r for r in Page(PAGE).tables[1].rows}
    for key, page, name, _ in sources:
        got = listed[f"[{key}]({name})"]
        assert (got["commit"], got["date"]) == (page.provenance().commit, page.provenance().date), name
    # the planned peaks' ratios are each row's peak over adam's, as printed
    adam = float(rows[module.ROWS[0].method]["planned peak (GiB)"])
    for row in rows.values():
        assert abs(float(row["planned peak (GiB)"]) / adam - float(row["× adam's peak"])) <= 0.011, row["method"]
