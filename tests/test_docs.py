"""The documentation: the site builds with `mkdocs build --strict` (a broken link or anchor, a page missing from the
nav, an API object that no longer exists fails it), the Python API's example trains privately, and every page the
CLI's help names exists and is in the site."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import dp_accounting
import pytest
import yaml

from dpmem.usage import USAGE, VERB_DOCS

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def example():
    spec = importlib.util.spec_from_file_location("private_loop", ROOT / "examples" / "private_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("method", [None, "grape"])
def test_the_api_example_trains_privately_at_the_epsilon_it_asks(method):
    """Privatizer with torch's Adam, and a whole dpmem method, on the example's loop: the ε it reports is what
    dp-accounting's PLD accountant gives for its σ, q and steps (and within the target), and it learns (chance
    is 0.1)."""
    steps, q = 60, 64 / 1500
    out = example().train(steps=steps, method=method, seed=3)
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(out["sigma"])), steps)
    assert math.isclose(out["epsilon"], accountant.get_epsilon(1e-5), rel_tol=1e-3)
    assert 7.9 < out["epsilon"] <= 8.0 * 1.001
    assert out["accuracy"] > 0.5, out


def nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for v in node.values() for p in nav_pages(v)]
    return [p for v in node for p in nav_pages(v)]


def test_the_sites_tables_keep_identifiers_whole_and_scroll_sideways():
    """Issue 73: Material breaks inline code anywhere, so a table's keys broke mid-word (`train.physical_b|atch_size`),
    every few characters on a phone. The site's stylesheet breaks a table's code at its spaces only."""
    css = (ROOT / "docs" / yaml.safe_load((ROOT / "mkdocs.yml").read_text())["extra_css"][0]).read_text()
    rule = re.search(r"\.md-typeset table:not\(\[class\]\) code \{([^}]*)\}", css).group(1)
    for setting in ("word-break: normal", "overflow-wrap: normal", "white-space: normal"):
        assert setting in rule, setting
    assert re.search(r"\.md-typeset__scrollwrap \{[^}]*overflow-x: auto", css)


def test_every_page_the_help_names_exists_and_is_in_the_site():
    named = set(re.findall(r"docs/[\w/-]+\.md", USAGE)) | set(VERB_DOCS.values())
    nav = {f"docs/{p}" for p in nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])}
    assert set(VERB_DOCS) == {"train", "memory", "plan", "check", "spectrum", "audit", "report"}
    for page in named:
        assert (ROOT / page).is_file() and page in nav, page


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs extra: pip install -e '.[docs]'")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "Privatizer" in api and "epsilon_spent" in api  # mkdocstrings rendered the API's objects
    # every name users import from dpmem.api has its heading under that path, and no heading names another path
    import dpmem.api
    headings = set(re.findall(r'id="(dpmem\.[\w.]+)" class="doc doc-heading"', api))
    assert {f"dpmem.api.{name}" for name in dpmem.api.__all__} <= headings
    assert all(h.startswith("dpmem.api") for h in headings), headings
    changelog = (tmp_path / "site" / "changelog" / "index.html").read_text()
    assert f">{PROJECT['version']} (" in changelog  # CHANGELOG.md included whole, its newest heading shown
    # search: a key is found by its last part on every page that names it dotted (train.physical_batch_size)
    index = json.loads((tmp_path / "site" / "search" / "search_index.json").read_text())
    separator = re.compile(index["config"]["separator"])
    pages = {d["location"].split("#")[0] for d in index["docs"] if "physical_batch_size" in d["text"]}
    words = [(d["location"].split("#")[0], separator.split(re.sub("<[^>]+>", " ", d["text"]))) for d in index["docs"]]
    found = {page for page, split in words if "physical_batch_size" in split}
    assert len(pages) >= 6 and found == pages, pages - found


def test_the_changelog_citation_and_licence_name_the_version_and_licence_of_pyproject():
    """The version and the licence are written in four files; pyproject.toml's are the ones a wheel carries."""
    newest = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert newest == citation["version"] == PROJECT["version"]
    assert citation["license"] == PROJECT["license"] == "Apache-2.0"
    assert re.match(r"\s*Apache License\s+Version 2\.0, January 2004", (ROOT / "LICENSE").read_text())


def test_every_sharp_edge_has_one_severity_and_the_summary_table_agrees():
    """The table at the top of sharp-edges.md is written by hand beside the sections: each section's severity line
    and its row must say the same, and no section may be missing from the table."""
    text = (ROOT / "docs" / "sharp-edges.md").read_text()
    sections = re.findall(r"^## ([^\n{]+?)(?: \{#[\w-]+\})?\n\n\*\*Severity: (\w+)\.\*\*\n", text, re.M)
    rows = re.findall(r"^\| \[([^\]]+)\]\(#[\w-]+\) \| (\w+) \|", text, re.M)
    assert len(sections) == text.count("\n## ") and len(sections) >= 18
    assert sections == rows
    assert {severity for _, severity in sections} <= {"critical", "high", "medium", "low"}
