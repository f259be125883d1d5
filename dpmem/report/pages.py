"""Read figures back from the markdown pages that the benchmark scripts write (docs/benchmarks/*.md): their tables,
cell by cell, and the provenance line at their top (command, device, commit, date).

A page that quotes another page's figure (the README, the methods page, the one table of methods) reads the figure
here, so that a test can hold the quote to the cited page. Every lookup that finds nothing raises `LookupError`
naming the page, the table and the row it looked for: a missing figure is an error, never a blank cell."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Table:
    """One markdown table: `heading` is the nearest heading above it ("" if none), `columns` its header (a name
    repeated is numbered: the peers' page has "× AdamW" twice, speed then memory, read as "× AdamW" and
    "× AdamW 2"), `rows` one {column: cell} per row."""

    heading: str
    columns: list[str]
    rows: list[dict[str, str]] = field(default_factory=list)


@dataclass
class Provenance:
    """What a benchmark page's "Written by `COMMAND`. Device: ...; ...; dpmem COMMIT; DATE; ..." line says."""

    command: str
    device: str
    commit: str
    date: str


def _cells(line: str) -> list[str]:
    # a pipe escaped as \| is part of a cell
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def tables(text: str) -> list[Table]:
    """Every markdown table of `text`, in order."""
    out: list[Table] = []
    heading, current, fenced = "", None, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or line.lstrip().startswith("```"):  # a code block's lines are neither headings nor tables
            current = None
            continue
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if not line.startswith("|"):
            current = None
            continue
        cells = _cells(line)
        if current is None:
            columns = [c if c not in cells[:i] else f"{c} {cells[:i].count(c) + 1}" for i, c in enumerate(cells)]
            current = Table(heading, columns)
            out.append(current)
        elif not set(line.strip()) <= set("|-: "):
            current.rows.append(dict(zip(current.columns, cells)))
    return out


@dataclass
class Page:
    """A markdown page, read once: `cell` finds one figure in its tables, `provenance` its header line."""

    path: Path
    text: str = ""

    def __post_init__(self):
        self.path = Path(self.path)
        if not self.text:
            if not self.path.is_file():
                raise LookupError(f"{self.path}: no such page")
            self.text = self.path.read_text()
        self.tables = tables(self.text)

    def rows(self, heading: str | None = None, **match: str) -> list[dict[str, str]]:
        """The rows whose cells equal `match` ({column: text}; pass a column whose name is not a Python name as
        `**{"peak (MiB)": ...}`), in tables whose heading contains `heading` (any table if None)."""
        found = []
        for table in self.tables:
            if heading is not None and heading not in table.heading:
                continue
            found += [r for r in table.rows if all(r.get(k) == v for k, v in match.items())]
        return found

    def row(self, heading: str | None = None, **match: str) -> dict[str, str]:
        """The one row that `rows` finds; LookupError if none or several."""
        found = self.rows(heading, **match)
        if len(found) != 1:
            where = f" under a heading holding {heading!r}" if heading is not None else ""
            raise LookupError(f"{self.path}: {len(found)} rows{where} match {match} (one expected)")
        return found[0]

    def cell(self, column: str, heading: str | None = None, **match: str) -> str:
        """The text of `column` in the one row matching `match` (see `row`); LookupError if it is not there."""
        r = self.row(heading, **match)
        if column not in r or r[column] in ("", "-"):
            raise LookupError(f"{self.path}: no figure in column {column!r} of the row {match}")
        return r[column]

    def number(self, column: str, heading: str | None = None, **match: str) -> float:
        """`cell` as a number: its first figure (1.33e+03, 13.13 of "13.13 (1.03× adam)", 88.3 of "88.3 ± 0.8")."""
        text = self.cell(column, heading, **match)
        value = number(text)
        if value is None:
            raise LookupError(f"{self.path}: {column!r} of {match} is {text!r}, not a number")
        return value

    def column(self, column: str, heading: str | None = None, **match: str) -> list[float]:
        """Every number of `column` over the rows that match (`rows`); LookupError if there is none."""
        values = [number(r.get(column, "")) for r in self.rows(heading, **match)]
        values = [v for v in values if v is not None]
        if not values:
            raise LookupError(f"{self.path}: no number in column {column!r} of rows {match}")
        return values

    def provenance(self) -> Provenance:
        """The page's "Written by `COMMAND`. Device: ...; dpmem COMMIT; DATE" line; LookupError without one."""
        line = next((x for x in self.text.splitlines() if x.startswith("Written by `")), None)
        if line is None:
            raise LookupError(f"{self.path}: no 'Written by' line")
        command = re.match(r"Written by `([^`]+)`", line)
        device = re.search(r"Device: ([^;]+);", line)
        commit = re.search(r"\bdpmem ([0-9a-f]{7,40})\b", line)
        date = re.search(r"\b(\d{4}-\d{2}-\d{2})\b", line)
        if not (command and device and commit and date):
            raise LookupError(f"{self.path}: its 'Written by' line lacks a command, device, commit or date")
        return Provenance(command.group(1), device.group(1).strip(), commit.group(1), date.group(1))


def number(text: str | None) -> float | None:
    """The first figure of `text` (1.33e+03, 0.93, 4,386), or None."""
    match = re.search(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", text or "")
    return float(match.group().replace(",", "")) if match else None
