"""The pages a user reads (README.md and every page in the site's nav, with the files they include by snippet) hold
no words of the project's own process: no tracker numbers, no word of who ran a measurement or how a machine's time
ran out, no path a user's clone does not have, and no private shorthand ("the one capture"). And `dpmem --help` names
the pages a user needs when something fails."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dpmem.usage import USAGE
from test_docs import nav_pages

ROOT = Path(__file__).resolve().parents[1]

# (what it catches, the pattern): searched in a page's whole text, code included
PROCESS_WORDS = [
    ("a tracker number", re.compile(r"\bissues? #?\d+", re.IGNORECASE)),
    ("a path outside the clone", re.compile(r"\.\./shared")),
    ("who ran it", re.compile(r"\bhelpers?\b", re.IGNORECASE)),
    ("who ran it", re.compile(r"\bthis session\b", re.IGNORECASE)),
    ("a machine's time", re.compile(r"\bdevice time\b", re.IGNORECASE)),
    ("undefined shorthand", re.compile(r"\bthe one capture\b", re.IGNORECASE)),
]
# searched in prose only: fenced and inline code, link targets, attribute lists ({#id}) and HTML tags taken out
ISSUE_REF = re.compile(r"(?<![\w&/])#\d{2,}\b")


def user_pages() -> list[Path]:
    """README.md, every nav page, and every file a page includes through pymdownx.snippets (`--8<-- "FILE"`, relative
    to the repository root, the site's snippet base path)."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = [ROOT / "README.md"] + [ROOT / "docs" / p for p in nav_pages(nav)]
    for page in [p for p in pages if p.is_file()]:  # a nav page that is missing fails the tests below
        pages += [ROOT / name for name in re.findall(r'^-{1,2}8<-{1,2}\s+"([^"]+)"', page.read_text(), re.M)]
    return list(dict.fromkeys(pages))


def blank(m: re.Match) -> str:
    return re.sub(r"[^\n]", " ", m.group(0))  # the same length and lines, so that offsets still name the line


def prose(text: str) -> str:
    text = re.sub(r"^ *(```|~~~).*?^ *\1", blank, text, flags=re.S | re.M)  # fenced code
    text = re.sub(r"`[^`\n]*`", blank, text)                                 # inline code
    text = re.sub(r"\]\([^)\s]*\)", blank, text)                            # link targets (page#anchor)
    text = re.sub(r"\{[^}\n]*\}", blank, text)                               # attribute lists: {#anchor}
    return re.sub(r"<[^>\n]+>", blank, text)                                 # HTML tags (style="color: #333")


def process_words(text: str) -> list[tuple[int, str]]:
    """(offset, what) of each process word in `text`."""
    found = [(m.start(), f"{what}: {m.group(0)!r}")
             for what, pattern in PROCESS_WORDS for m in pattern.finditer(text)]
    return found + [(m.start(), f"an issue reference: {m.group(0)!r}") for m in ISSUE_REF.finditer(prose(text))]


def test_the_user_pages_are_readme_the_nav_and_their_snippets():
    pages = {p.relative_to(ROOT).as_posix() for p in user_pages()}
    assert {"README.md", "docs/index.md", "docs/faq.md", "docs/run-folders.md", "docs/benchmarks/index.md",
            "docs/changelog.md", "CHANGELOG.md"} <= pages
    assert all((ROOT / p).is_file() for p in pages)


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in user_pages()])
def test_no_user_page_holds_words_of_the_projects_process(page):
    assert (ROOT / page).is_file(), f"{page} is named by mkdocs.yml's nav or a snippet, and missing"
    text = (ROOT / page).read_text()
    found = [f"{page}:{text.count(chr(10), 0, at) + 1}: {what}" for at, what in sorted(process_words(text))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("text", [
    "the ten faults (issue 54's broken mechanisms)", "Issue 32's table", "fixed in #67.", "see issues #12 and 13",
    "wheels from ../shared/tools/gpu-wheels", "a helper ran it", "measured in this session",
    "the device time ran out", "since the one capture",
])
def test_the_check_catches_each_kind(text):
    assert process_words(text), text


@pytest.mark.parametrize("text", [
    "## 0.1.0", "[page](memory.md#planned-peaks-roberta-large)", "### On an H100 {#on-an-nvidia-h100}",
    "`git show #123`", "```bash\ngit log --grep=#123\n```", '<span style="color: #333333">x</span>',
    "the device's time and the host's", "one capture, taps, serves every path", "issues with the hub",
])
def test_the_check_passes_headings_anchors_code_and_plain_words(text):
    assert not process_words(text), text


def test_the_help_names_the_faq_run_folders_and_a_newcomers_pages():
    out = subprocess.run([sys.executable, "-m", "dpmem", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for page in ("docs/faq.md", "docs/run-folders.md", "docs/tutorial.md", "docs/configuration.md",
                 "docs/opacus.md"):
        assert page in out.stdout and page in USAGE, page
