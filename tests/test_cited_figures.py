"""Every figure that the README, the home page, the methods page and the FAQ quote from a benchmark page is the cited
page's figure, rounded as quoted.

QUOTES lists each quote: the quoting page, the quoted text (line breaks read as spaces), the cited page, and how to
read the figure from the cited page's table (`dpmem.report.pages`). Every number in the quoted text is a figure, and
`read` returns them in the same order. A quote reworded, or a cited page rerun with other figures, fails here: update
the quote to the cited page's figure (or the entry, if the quote moved). A figure (× ratio, MiB, GiB, samples/s, %)
written in a paragraph that links a page of docs/benchmarks/ must be in QUOTES, or in NOT_CHECKED with the reason."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from dpmem.report.pages import Page, number

ROOT = Path(__file__).resolve().parent.parent
QUOTING = ("README.md", "docs/index.md", "docs/methods.md", "docs/faq.md")
BENCH = "docs/benchmarks"


@dataclass(frozen=True)
class Quote:
    page: str  # the quoting page, from the repository's root
    text: str  # the quoted text: every number in it is a figure
    cited: str  # the cited page, from the repository's root
    read: Callable[[Page], tuple[float, ...]]  # the figures on the cited page, in the quote's order
    linked: bool = True  # the quote's paragraph links the cited page (False: the page is cited in words, or above)


def eager(page, contestant, column, heading=None):
    return page.number(column, heading, contestant=contestant)


def peers(b, contestant):
    """(speed × AdamW, peak × AdamW) of a contestant at batch `b` on a peers page."""
    return lambda p: (p.number("× AdamW", B=str(b), contestant=contestant),
                      p.number("× AdamW 2", B=str(b), contestant=contestant))


def peers_16_32(name: str):
    """A contestant's samples/s and peak ratios at B = 16 and 32, as methods.md quotes them: (s16, s32, m16, m32)."""
    return lambda p: (peers(16, name)(p)[0], peers(32, name)(p)[0], peers(16, name)(p)[1], peers(32, name)(p)[1])


def planned(method, column="peak GiB"):
    """A row of memory.md's "Planned peaks: RoBERTa-large" table."""
    return lambda p: p.number(column, "Planned peaks: RoBERTa-large", method=method)


def precision(method, precision="fp32"):
    return lambda p: p.number("peak allocated MiB", method=method, precision=precision)


CUDA_COMPILE = f"{BENCH}/compile-cuda-tf32.md"
CPU_COMPILE = f"{BENCH}/compile.md"
BK_C, GRAPE_C = "dpmem dp-adam (bk), compiled", "dpmem grape, compiled"
GHOST_CK = "dpmem dp-adam (ghost), checkpointed"

QUOTES = [
    # README: the planner against an H200, and the compiled step on the H200 and on the CPU
    Quote("README.md", "its plans were 0.97–1.05 of the allocated peaks", f"{BENCH}/validate-memory-cuda.md",
          lambda p: (min(p.column("plan / allocated")), max(p.column("plan / allocated")))),
    Quote("README.md", "and 0.99 of a whole `dpmem train` run's peak", f"{BENCH}/validate-memory-cuda.md",
          lambda p: (p.number("plan ÷ measured", run="dpmem train method=grape (training and evaluation, "
                                                      "allocated)"),)),
    Quote("README.md", "runs dp-adam at 0.93× compiled AdamW's samples/s", CUDA_COMPILE,
          lambda p: (eager(p, BK_C, "× AdamW compiled"),)),
    Quote("README.md", "(1.35× eager AdamW", CUDA_COMPILE, lambda p: (eager(p, BK_C, "× AdamW eager"),)),
    Quote("README.md", "5.2× Opacus' hooks", CUDA_COMPILE,
          lambda p: (eager(p, BK_C, "samples/s") / eager(p, "Opacus hooks", "samples/s"),)),
    Quote("README.md", "grape at 1.34× compiled AdamW's", CUDA_COMPILE,
          lambda p: (eager(p, GRAPE_C, "× AdamW compiled"),)),
    Quote("README.md", "it runs at 3.35× eager AdamW where the host bounds the step", CPU_COMPILE,
          lambda p: (eager(p, BK_C, "× AdamW eager", "host-bound"),)),
    Quote("README.md", "and 0.93× compiled AdamW where compute does", CPU_COMPILE,
          lambda p: (eager(p, BK_C, "× AdamW compiled", "compute-bound"),)),
    # README's headline peaks (H100, precision_runs.py): the run's table is on the methods page
    *(Quote("README.md", f"| {label} | {mib} | {ratio} |", "docs/methods.md",
            lambda p, m=method: (precision(m)(p), precision(m)(p) / precision("adam")(p)), linked=False)
      for label, mib, ratio, method in (
          ("adam (non-private)", 4026, "1.00", "adam"),
          ("dp-adam, `bk` clipping (dpmem's default)", 4386, "1.09", "dp-adam (bk)"),
          ("grape", 4810, "1.19", "grape"),
          ("dp-adam, per-sample gradients materialised (as Opacus' hooks do)", 15401, "3.83",
           "dp-adam materialize"))),
    # README: grape's peak as a multiple of Adam's elsewhere, each with its setting (issue 73: 1.19× beside 0.95×,
    # 0.83× and 0.84× said nothing of which was which)
    Quote("README.md", "embeddings frozen: 0.95×", f"{BENCH}/peers-cuda-tf32.md",
          lambda p: (peers(32, "dpmem grape")(p)[1],)),
    Quote("README.md", "embeddings frozen: 0.83×", f"{BENCH}/methods-table.md",
          lambda p: (p.number("× adam's peak", method="`method=grape` (r = 16)"),)),
    Quote("README.md", "The same plan with the embeddings trained: 0.84×", "docs/tutorial.md",
          lambda p: (p.number("peak GiB", method="`grape`") / p.number("peak GiB", method="`adam`"),)),
    # README: correlated noise at independent noise's learning rate, and at the step-noise-matched one
    Quote("README.md", "dp-adam 81.1 % → 39.1 %", f"{BENCH}/correlated.md",
          lambda p: (accuracy("dp-adam", "independent")(p), accuracy("dp-adam", "bandmf")(p))),
    Quote("README.md", "(85.8 % there", f"{BENCH}/correlated.md",
          lambda p: (accuracy("dp-adam", "bandmf, lr matched")(p),)),
    Quote("docs/faq.md", "dp-adam fell from 81.1 % to 39.1 %", f"{BENCH}/correlated.md",
          lambda p: (accuracy("dp-adam", "independent")(p), accuracy("dp-adam", "bandmf")(p))),
    # methods.md: planned peaks (memory.md), the peers on the CPU, the compiled step on the CPU and the H200
    Quote("docs/methods.md", "the planned peak is 1.03× Adam's on RoBERTa-large", "docs/memory.md",
          lambda p: (planned("dp-adam, bk (default)")(p) / planned("adam (non-private)")(p),), linked=False),
    Quote("docs/methods.md", "adam 12.75 GiB, dp-adam (bk) 13.13, dp-adam (materialize) 50.79, grape 10.34 (3.17 with "
          "activation checkpointing)", "docs/memory.md",
          lambda p: (planned("adam (non-private)")(p), planned("dp-adam, bk (default)")(p),
                     planned("dp-adam, `method.clipping=materialize`")(p), planned("grape")(p),
                     planned("grape", "with `train.activation_checkpointing=true`")(p))),
    Quote("docs/methods.md", "bk 0.79× / 0.79× at 1.02× / 1.04×", f"{BENCH}/peers.md",
          peers_16_32("dpmem dp-adam (bk)")),
    Quote("docs/methods.md", "ghost 0.65× / 0.66× at 1.02× / 1.03×", f"{BENCH}/peers.md",
          peers_16_32("dpmem dp-adam (ghost)")),
    Quote("docs/methods.md", "materialize 0.32× / 0.38× at 2.17× / 2.44×", f"{BENCH}/peers.md",
          peers_16_32("dpmem dp-adam (materialize)")),
    Quote("docs/methods.md", "hooks 0.21× / 0.19× at 2.36× / 2.57×", f"{BENCH}/peers.md",
          peers_16_32("Opacus hooks")),
    Quote("docs/methods.md", "bk plans 13.13 GiB, ghost 12.75, materialize 50.79, against non-private adam's 12.75",
          "docs/memory.md",
          lambda p: (planned("dp-adam, bk (default)")(p), planned("dp-adam, `method.clipping=ghost`")(p),
                     planned("dp-adam, `method.clipping=materialize`")(p), planned("adam (non-private)")(p))),
    Quote("docs/methods.md", "ghost plans 6.62 GiB on the RoBERTa-large example above; bk plans 13.13",
          "docs/memory.md",
          lambda p: (planned("dp-adam, `method.clipping=ghost`", "with `train.activation_checkpointing=true`")(p),
                     planned("dp-adam, bk (default)", "with `train.activation_checkpointing=true`")(p)),
          linked=False),
    Quote("docs/methods.md", "Compiled grape runs at 0.69× compiled AdamW's samples/s at the benchmark's host-bound "
          "shape and 1.33× at its compute-bound one", CPU_COMPILE,
          lambda p: (eager(p, GRAPE_C, "× AdamW compiled", "host-bound"),
                     eager(p, GRAPE_C, "× AdamW compiled", "compute-bound"))),
    Quote("docs/methods.md", "1.21× eager AdamW's samples/s at the host-bound shape, where eager it runs at 0.22×",
          CPU_COMPILE,
          lambda p: (eager(p, f"{GHOST_CK}, compiled", "× AdamW eager", "host-bound"),
                     eager(p, GHOST_CK, "× AdamW eager", "host-bound"))),
    Quote("docs/methods.md", "(17.3 samples/s both, 0.40× and 0.39× eager AdamW)", CPU_COMPILE,
          lambda p: (eager(p, f"{GHOST_CK}, compiled", "samples/s", "compute-bound"),
                     eager(p, f"{GHOST_CK}, compiled", "× AdamW eager", "compute-bound"),
                     eager(p, GHOST_CK, "× AdamW eager", "compute-bound"))),
    Quote("docs/methods.md", "the compiled dp-adam (bk) runs at 0.93× compiled AdamW's samples/s and 1.35× eager "
          "AdamW's", CUDA_COMPILE,
          lambda p: (eager(p, BK_C, "× AdamW compiled"), eager(p, BK_C, "× AdamW eager"))),
    Quote("docs/methods.md", "The compiled grape runs at 1.34× compiled AdamW's", CUDA_COMPILE,
          lambda p: (eager(p, GRAPE_C, "× AdamW compiled"),)),
]


def table(method, column="× adam's peak"):
    """A row of the one table of methods."""
    return lambda p: p.number(column, method=method)


def comm(model, method):
    return lambda p: p.number("dp-adam's ÷ this", model=model, method=method)


def accuracy(method, column):
    return lambda p: p.number(column, task="vit-digits", method=method, ε="8")


INDEX = f"{BENCH}/index.md"
QUOTES += [
    # the benchmarks' first table: today's figures, each from its page
    Quote(INDEX, "dp-adam (bk) 1.01×, grape 0.83×, dp-adam (materialize) 3.15×, dpzero 0.16×", f"{BENCH}/methods-table.md",
          lambda p: tuple(table(m)(p) for m in ("`method=dp-adam` (bk clipping, the default)", "`method=grape` (r = 16)",
                                                "`method=dp-adam method.clipping=materialize`", "`method=dpzero`"))),
    Quote(INDEX, "| 0.97–1.05 |", f"{BENCH}/validate-memory-cuda.md",
          lambda p: (min(p.column("plan / allocated")), max(p.column("plan / allocated")))),
    Quote(INDEX, "dp-adam (bk) 0.57× at 1.13×; grape 0.77× at 0.95×; Opacus' hooks 0.44× at 3.42×",
          f"{BENCH}/peers-cuda-tf32.md",
          lambda p: (*peers(32, "dpmem dp-adam (bk)")(p), *peers(32, "dpmem grape")(p), *peers(32, "Opacus hooks")(p))),
    Quote(INDEX, "dp-adam (bk) 0.93×, grape 1.34×; dp-adam 5.2× Opacus' hooks", CUDA_COMPILE,
          lambda p: (eager(p, BK_C, "× AdamW compiled"), eager(p, GRAPE_C, "× AdamW compiled"),
                     eager(p, BK_C, "samples/s") / eager(p, "Opacus hooks", "samples/s"))),
    Quote(INDEX, "dp-adam (bk) 3.35× eager AdamW (host-bound); dp-adam 0.93×, grape 1.33× compiled AdamW (compute-bound)",
          CPU_COMPILE,
          lambda p: (eager(p, BK_C, "× AdamW eager", "host-bound"), eager(p, BK_C, "× AdamW compiled", "compute-bound"),
                     eager(p, GRAPE_C, "× AdamW compiled", "compute-bound"))),
    Quote(INDEX, "dp-adam (bk) 0.79× at 1.04×; grape 1.21× at 0.91×; Opacus' hooks 0.19× at 2.57×", f"{BENCH}/peers.md",
          lambda p: (*peers(32, "dpmem dp-adam (bk)")(p), *peers(32, "dpmem grape")(p), *peers(32, "Opacus hooks")(p))),
    Quote(INDEX, "dp-adam (bk) 1.29×, grape 1.28×; Opacus' hooks 2.94×", f"{BENCH}/peers-ops.md",
          lambda p: tuple(p.number("× AdamW 3", B="2", contestant=c)
                          for c in ("dpmem dp-adam (bk)", "dpmem grape", "Opacus hooks"))),
    Quote(INDEX, "grape 3.0× (roberta-base), 6.1× (roberta-large); with its embeddings projected 37.8× and 51.1×",
          f"{BENCH}/comm.md",
          lambda p: (comm("roberta-base", "grape")(p), comm("roberta-large", "grape")(p),
                     comm("roberta-base", "grape, embeddings projected")(p),
                     comm("roberta-large", "grape, embeddings projected")(p))),
    Quote(INDEX, "dp-adam 85.8 % against 81.1 %; grape 83.5 % against 81.2 %", f"{BENCH}/correlated.md",
          lambda p: (accuracy("dp-adam", "bandmf, lr matched")(p), accuracy("dp-adam", "independent")(p),
                     accuracy("grape", "bandmf, lr matched")(p), accuracy("grape", "independent")(p))),
]

# figures written beside a link to a benchmark page that no table holds, each with why it is not checked
NOT_CHECKED: dict[tuple[str, str], str] = {}

FIGURE = re.compile(r"\d[\d,]*(?:\.\d+)?")
UNIT = re.compile(r"\d[\d,]*(?:\.\d+)?(?:–\d[\d,]*(?:\.\d+)?)?(?:×| ?%| ?MiB| ?GiB| samples/s)")
LINK = re.compile(r"\]\(((?:\.\./)*(?:docs/)?(?:benchmarks/)?[\w.-]+\.md)(?:#[\w-]*)?\)")


def blocks(text: str) -> list[str]:
    """A page's paragraphs, list items and table rows, each on one line (line breaks read as spaces); code blocks
    left out."""
    out, current, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append(" ".join(current))
            current = []
            continue
        if fenced:
            continue
        if not line.strip() or re.match(r"\s*([-*]|\d+\.)\s|\||#", line):
            out.append(" ".join(current))
            current = []
        if line.strip():
            current.append(line.strip())
    out.append(" ".join(current))
    return [b for b in out if b]


def links(page: str, block: str) -> set[str]:
    """The pages a block links, from the repository's root."""
    folder = (ROOT / page).parent
    return {str((folder / target).resolve().relative_to(ROOT)) for target in LINK.findall(block)}


def rounded(value: float, quoted: str) -> str:
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    return f"{value:,.{decimals}f}" if "," in quoted else f"{value:.{decimals}f}"


@pytest.mark.parametrize("quote", QUOTES, ids=[f"{q.page}: {q.text[:50]}" for q in QUOTES])
def test_a_quoted_figure_is_the_cited_pages(quote):
    found = [b for b in blocks((ROOT / quote.page).read_text()) if quote.text in b]
    assert found, f"{quote.page} no longer says {quote.text!r}: update QUOTES (and the figure, if it moved)"
    if quote.linked:
        assert any(quote.cited in links(quote.page, b) for b in found), \
            f"{quote.page}: the paragraph quoting {quote.text!r} does not link {quote.cited}"
    quoted = FIGURE.findall(quote.text)
    figures = quote.read(Page(ROOT / quote.cited))
    assert len(figures) == len(quoted), (quoted, figures)
    cited = [rounded(v, q) for v, q in zip(figures, quoted)]
    assert cited == quoted, f"{quote.page} quotes {quoted} where {quote.cited} says {cited}: {quote.text!r}"


def test_every_figure_beside_a_benchmark_link_is_checked():
    missing = []
    for page in QUOTING:
        quotes = [q.text for q in QUOTES if q.page == page]
        for block in blocks((ROOT / page).read_text()):
            if not any(t.startswith(BENCH) for t in links(page, block)):
                continue
            covered = [(m.start(), m.end()) for q in quotes for m in re.finditer(re.escape(q), block)]
            for figure in UNIT.finditer(block):
                inside = any(a <= figure.start() and figure.end() <= b for a, b in covered)
                if not inside and (page, figure.group()) not in NOT_CHECKED:
                    missing.append(f"{page}: {figure.group()!r} in {block[max(0, figure.start() - 60):figure.end() + 40]!r}")
    assert not missing, "figures beside a benchmark link that QUOTES does not check:\n" + "\n".join(missing)


def test_the_default_runs_accuracy_is_the_same_range_wherever_it_is_said():
    """Issue 73: the Opacus page said 83–88 % where the README and getting started said 82–88 %. Every page that
    speaks of the default run, or of the fresh clones it was measured in, quotes getting started's range."""
    section = (ROOT / "docs/getting-started.md").read_text().split("## The default run")[1].split("\n## ")[0]
    (range_,) = set(re.findall(r"\d+–\d+ %", section))
    quoted = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in blocks(path.read_text()):
            if "default run" in block or "fresh clones" in block:
                for found in re.findall(r"\d+–\d+ %", block):
                    quoted[f"{path.relative_to(ROOT)}: {found}"] = found
    assert len(quoted) >= 3 and set(quoted.values()) == {range_}, quoted


def test_the_figure_reader_fails_loudly_on_a_missing_row():
    with pytest.raises(LookupError, match="compile-cuda-tf32.md"):
        Page(ROOT / CUDA_COMPILE).number("× AdamW eager", contestant="dpmem dp-adam (fgc), compiled")
    assert number("1.33e+03") == 1330 and number("13.13 (1.03× adam)") == 13.13 and number("4,386") == 4386


def test_the_benchmarks_index_opens_with_each_figures_page_command_commit_and_date():
    """The first table of docs/benchmarks/index.md: its figures are in QUOTES; here, each row's command, commit and
    date are its page's own (the "Written by" line)."""
    index = Page(ROOT / INDEX)
    assert index.tables[0].heading == "Current figures"
    assert re.findall(r"^## (.+)$", index.text, re.M)[0] == "Current figures"  # the page's first section
    rows = index.tables[0].rows
    assert len(rows) >= 8
    for row in rows:
        page = Page(ROOT / BENCH / re.search(r"\]\(([\w.-]+\.md)\)", row["page"]).group(1))
        made = page.provenance()
        assert row["command"] == f"`{made.command}`", page.path.name
        assert row["commit"].split()[0] == made.commit and row["date"] == made.date, page.path.name
        assert any(q.page == INDEX and q.cited.endswith("/" + page.path.name) and q.text.strip("| ") in row["figure"]
                   for q in QUOTES), f"no QUOTES entry checks the figure of {page.path.name}"


def test_the_benchmarks_section_is_shorter_than_the_rest_of_the_nav():
    """Folded, the Benchmarks section shows one line per page or section: fewer than the rest of the nav."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    section = next(item["Benchmarks"] for item in nav if isinstance(item, dict) and "Benchmarks" in item)
    rest = [item for item in nav if not (isinstance(item, dict) and "Benchmarks" in item)]
    assert len(section) < len(rest), (len(section), len(rest))
