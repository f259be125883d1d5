"""`dpmem report PATH...`: every run's summary.json under the given folders as the papers' tables.

Rows are method × ε (and, within a method, the settings that differ between its runs, such as a swept
method.subspace.k), columns are tasks (data sets); a cell is the final metric's mean ± standard error over seeds,
in percent (accuracy, F1, EM, ROUGE-1 are fractions in the summaries). A cell whose runs ran out of memory says OOM;
the best private result of each column is marked (bold in markdown, \\textbf in LaTeX). Runs that did not finish
ok (failed, interrupted, still running or dead with status running), run folders with no summary and repeats of
a run (the same configuration and seed) are listed, never silently dropped or counted twice. Written as report.md,
report.csv (one line per cell) and report.tex, with the figures of `dpmem.report.figures`."""

from __future__ import annotations

import csv
import functools
import json
import math
import re
import statistics
from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf

from dpmem.data import is_loss
from dpmem.engine.summary import PRIVACY_LEDGER, most_spent, privacy_records
from dpmem.report import figures
from dpmem.report.labels import NOT_TRAINING, row_label, variants

OK = "ok"


REQUIRED = ("status", "method", "data")  # what a row needs; every other field a summary may lack (older versions)


def collect(paths: list[Path]) -> tuple[list[dict], list[str]]:
    """Every readable summary under `paths`, and a line (folder: why) for each run folder that has none or an
    unreadable one: those are listed under the table, and the report goes on."""
    summaries, missing = [], []
    for root in paths:
        root = Path(root)
        if not root.exists():
            raise FileNotFoundError(f"{root} does not exist")
        for f in sorted(root.rglob("summary.json")):
            try:
                s = json.loads(f.read_text())
                lacking = [k for k in REQUIRED if k not in s] if isinstance(s, dict) else ["(not a JSON object)"]
            except (ValueError, OSError) as e:
                missing.append(f"{f.parent}: unreadable summary.json ({type(e).__name__}: {str(e)[:80]})"
                               + _ledger_note(f.parent))
                continue
            if lacking:
                missing.append(f"{f.parent}: summary.json lacks {', '.join(lacking)}" + _ledger_note(f.parent))
                continue
            s["run_dir"] = str(f.parent)
            config = f.parent / "config.yaml"
            s["config"] = _flat(OmegaConf.to_container(OmegaConf.load(config))) if config.exists() else {}
            summaries.append(s)
        folders = {c.parent for c in root.rglob("config.yaml") if c.parent.name != ".hydra"}
        folders |= {c.parent for c in root.rglob(PRIVACY_LEDGER)}
        for folder in sorted(folders):
            if not (folder / "summary.json").exists():
                note = _ledger_note(folder)
                missing.append(f"{folder}: no summary.json" + (note or " (the run died before it started)"))
    return summaries, missing


def _ledger_note(folder: Path) -> str:
    """What the folder's privacy.jsonl says was spent, for a run whose summary cannot be read."""
    records = privacy_records(folder)
    spent = most_spent(records)
    if spent is None:
        return ""
    steps = max(int(r.get("steps_done") or 0) for r in records)
    return f"; its {PRIVACY_LEDGER} records epsilon {spent:.4g} spent over {steps} steps"


def distinct(summaries: list[dict]) -> tuple[list[dict], list[str]]:
    """One run per configuration and seed, and a line for each run left out: two runs that train the same thing
    are one sample, not two seeds. The privacy options of a run without noise (adam under privacy=eps2 and eps8)
    train nothing different. An ok run is kept before one that is not."""
    kept: dict[str, dict] = {}
    repeats = []
    for s in sorted(summaries, key=lambda s: (s["status"] != OK, s["run_dir"])):
        config = s.get("config", {})
        if "train.seed" not in config:  # without its config.yaml, a run cannot be told to be another's repeat
            kept[s["run_dir"]] = s
            continue
        same = {k: v for k, v in config.items() if not k.startswith(NOT_TRAINING)
                and not (k.startswith("privacy.") and not s.get("sigma"))}
        key = json.dumps(same, sort_keys=True, default=str)
        if key in kept:
            repeats.append(f"{s['run_dir']}: the same configuration and seed as {kept[key]['run_dir']}, counted once"
                           + (f" ({s['privacy_ignored']})" if s.get("privacy_ignored") else ""))
        else:
            kept[key] = s
    chosen = {id(s) for s in kept.values()}
    return [s for s in summaries if id(s) in chosen], repeats


def _flat(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def _epsilon(s: dict) -> str:
    """The row's ε: non-private for non-private methods, noise-free runs and runs that leak (epsilon_spent inf)."""
    eps = s.get("epsilon_target")
    return "non-private" if eps is None or not s.get("private", True) else f"{eps:g}"


def cells(summaries: list[dict]) -> dict[tuple[str, str, str], dict]:
    """(method, ε, data) -> {values (final metric of each ok run), n, mean, se, oom, metric}."""
    variants(summaries)
    grouped: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for s in summaries:
        grouped[(row_label(s), _epsilon(s), s["data"])].append(s)
    out = {}
    for key, runs in grouped.items():
        values = [r["metric_final"] for r in runs if r["status"] == OK and r.get("metric_final") is not None]
        n = len(values)
        mean = statistics.fmean(values) if n else None
        se = statistics.stdev(values) / math.sqrt(n) if n > 1 else None
        out[key] = {"values": values, "n": n, "mean": mean, "se": se,
                    "oom": any(r["status"] == "oom" for r in runs), "private": key[1] != "non-private",
                    "paper": {_paper_key(r) for r in runs},
                    "metric": runs[0].get("metric_name")}
    return out


def _text(cell: dict | None) -> str:
    if cell is None:
        return ""
    if cell["n"] == 0:
        return "OOM" if cell["oom"] else "–"
    if is_loss(cell["metric"]):
        return f"{cell['mean']:.4g}" + (f" ± {cell['se']:.2g}" if cell["se"] is not None else "")
    text = f"{100 * cell['mean']:.1f}"
    return text + (f" ± {100 * cell['se']:.1f}" if cell["se"] is not None else "")


def _natural(label: str) -> list:
    """A row label's sort key with its numbers as numbers (dimension=3000 before dimension=10000)."""
    return [(0, float(part), "") if part.replace(".", "", 1).isdigit() else (1, 0.0, part)
            for part in re.split(r"(\d+(?:\.\d+)?)", label)]


def _epsilon_order(eps: str) -> float:
    return math.inf if eps == "non-private" else float(eps)


def table(table_cells: dict) -> tuple[list[str], list[tuple[str, str]], dict, set]:
    """Columns (tasks), rows (method, ε), cell texts and the best private cell per column."""
    columns = sorted({d for _, _, d in table_cells})
    rows = sorted({(m, e) for m, e, _ in table_cells}, key=lambda r: (_natural(r[0]), _epsilon_order(r[1])))
    best = set()
    for d in columns:
        private = [(-c["mean"] if is_loss(c["metric"]) else c["mean"], k) for k, c in table_cells.items()
                   if k[2] == d and c["private"] and c["n"]]
        if private:
            top = max(m for m, _ in private)
            best |= {k for m, k in private if m == top}
    return columns, rows, {k: _text(c) for k, c in table_cells.items()}, best


def memory_table(summaries: list[dict]) -> list[str]:
    """Peak memory (MiB) by method and model against the physical batch size, when some method ran at several."""
    peaks = defaultdict(dict)
    for s in summaries:
        if s["status"] == OK and s.get("peak_memory_bytes"):
            peaks[(s["method"], s.get("model"))][s.get("physical_batch_size", s.get("batch_size"))] = \
                s["peak_memory_bytes"] / 2**20
    if not any(len(v) > 1 for v in peaks.values()):
        return []
    batches = sorted({b for v in peaks.values() for b in v})
    sources = sorted({str(s.get("peak_memory_source")) for s in summaries if s.get("peak_memory_bytes")})
    lines = ["", f"Peak memory (MiB, {', '.join(sources)}) against the physical batch size:", "",
             "| method | model | " + " | ".join(map(str, batches)) + " |", "|---|---|" + "---|" * len(batches)]
    for (method, model), v in sorted(peaks.items(), key=lambda kv: max(kv[1].values())):
        lines.append(f"| {method} | {model} | " + " | ".join(f"{v[b]:.1f}" if b in v else "" for b in batches) + " |")
    return lines


def search_privacy(summaries: list[dict]) -> list[str]:
    """A line per data set that several accounted runs trained on: choosing and releasing the best of them (a
    search, a grid, a table) is a release of every one, so its ε is their mechanisms composed (dp-accounting, at
    the runs' largest δ). Runs count as touching the same data when they share data.name and data.path, whatever
    examples each drew: the conservative reading."""
    from dpmem.privacy import composed_epsilon
    groups = defaultdict(list)
    for s in summaries:
        if s.get("steps_done"):
            groups[(s["data"], s.get("config", {}).get("data.path"))].append(s)
    lines = []
    for (data, path), runs in sorted(groups.items(), key=str):
        accounted = [r for r in runs if r.get("accountant") and r.get("sigma")]
        if len(accounted) < 2:
            continue
        name = data + (f" ({path})" if path else "")
        if all(r.get("data_public") for r in runs):
            lines.append(f"{name}: {len(runs)} runs on data declared public (data.public=true), a proxy: searching "
                         "there spends nothing of a private data set's budget")
            continue
        own = max(float(r["epsilon_spent"]) for r in accounted)
        accountants = {(r["accountant"], r.get("neighbouring")) for r in accounted}
        delta = max(r["delta"] for r in accounted)
        if len(accountants) > 1 or ("rc", "add_remove") in accountants:
            lines.append(f"{name}: {len(accounted)} private runs on the same training data, each ε ≤ {own:.3g}; "
                         "their composition is not computed here (rc, or several accountants)")
            continue
        accountant, neighbouring = accountants.pop()
        composed = composed_epsilon([{"sigma": r["sigma"], "sample_rate": r["sample_rate"], "steps": r["steps_done"],
                                      "sampling": r.get("sampling", "poisson"), "dataset_size": r.get("n_train")}
                                     for r in accounted], delta, accountant, neighbouring or "add_remove")
        loose = len(runs) - len(accounted)
        lines.append(f"{name}: {len(accounted)} private runs on the same training data, each ε ≤ {own:.3g}; "
                     f"releasing the best of them releases all: ε = {composed:.4g} at δ = {delta:.2g} "
                     f"({accountant}, composed)" + (f"; {loose} more runs without noise release it outright"
                                                     if loose else ""))
    return lines


def unfinished(summaries: list[dict], missing: list[str]) -> list[str]:
    lines = [f"{s['run_dir']}: {s['status']}" + (f" ({s['error']})" if s.get("error") else "")
             + f", {s.get('steps_done')}/{s.get('steps')} steps" for s in summaries if s["status"] not in (OK, "oom")]
    lines += missing
    return lines


PUBLISHED = Path(__file__).with_name("published.csv")
ALIASES = {"adam": "adamw"}  # dpmem's name -> the papers' where they differ (AdamW is the papers' non-private row)


@functools.cache
def published() -> dict[tuple[str, str, str, str], dict]:
    """(method, ε, data, model) -> {value, se, source} from the papers' tables (published.csv, values in %, or
    OOM)."""
    with open(PUBLISHED, newline="") as f:
        return {(r["method"], r["epsilon"] or "non-private", r["data"], r["model"]): r for r in csv.DictReader(f)}


def _paper_key(s: dict) -> tuple[str, str]:
    """(method, model) as published.csv names them: METHOD/NORM_RULE where the paper has a row per norm rule
    (dp-sgd-rc/hutch), MODEL+lora for LoRA runs."""
    method = ALIASES.get(s["method"], s["method"])
    if f"{method}/{s.get('clipping')}" in {key[0] for key in published()}:
        method += f"/{s.get('clipping')}"
    lora = s.get("config", {}).get("model.lora.r") is not None
    return method, f"{s.get('model')}+lora" if lora else str(s.get("model"))


def with_published(table_cells: dict, texts: dict) -> tuple[dict, list[str]]:
    """Each cell's text followed by the paper's number for the same method, ε, data set and model, in brackets."""
    paper, sources, out = published(), [], dict(texts)
    for (row, eps, data), text in texts.items():
        keys = table_cells[(row, eps, data)]["paper"]
        hit = None
        if len(keys) == 1:
            method, model = next(iter(keys))
            hit = paper.get((method, eps, data, model))
        if hit is not None:
            out[(row, eps, data)] = f"{text} [{hit['value']}" + (f" ± {hit['se']}" if hit["se"] else "") + "]"
            sources.append(hit["source"])
    return out, sorted(set(sources))


def top_three(summaries: list[dict]) -> tuple[list[dict], list[str]]:
    """DP-SGD-RC's selection (§6): of each method × ε × data set's ok runs (a search's trials), the three with the
    lowest final training loss, and of those the best final metric. Returns the chosen runs and a line for each."""
    groups = defaultdict(list)
    for s in summaries:
        if s["status"] == OK and s.get("train_loss") is not None and s.get("metric_final") is not None:
            groups[(s["method"], _epsilon(s), s["data"])].append(s)
    chosen, lines = [], []
    for (method, eps, data), runs in sorted(groups.items()):
        three = sorted(runs, key=lambda r: r["train_loss"])[:3]
        best = (min if is_loss(three[0].get("metric_name")) else max)(three, key=lambda r: r["metric_final"])
        chosen.append(best)
        lines.append(f"{method}, ε {eps}, {data}: {best['run_dir']} (training loss {best['train_loss']:.4g}, "
                     f"{len(runs)} runs)")
    return chosen, lines


def write(out: Path, summaries: list[dict], missing: list[str], compare: bool = False,
          select: str | None = None) -> str:
    """report.md, report.csv and report.tex in `out` (with `compare`, the papers' numbers in brackets; with
    `select="top3"`, one run per method, ε and data set: `top_three`); returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    summaries, repeats = distinct(summaries)
    searched = search_privacy(summaries)  # every trial counts, whichever is shown
    chosen = []
    if select == "top3":
        summaries, chosen = top_three(summaries)
    table_cells = cells(summaries)
    columns, rows, texts, best = table(table_cells)
    sources = []
    if compare:
        texts, sources = with_published(table_cells, texts)
    metrics = sorted({str(c["metric"]) for c in table_cells.values()})
    md = [f"Final {', '.join(metrics)} ({'losses as they are, others ' if any(map(is_loss, metrics)) else ''}%), "
          "mean ± standard error over seeds; **bold**: best private result per column; OOM: out of memory.", "",
          "| method | ε | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    tex = [r"\begin{tabular}{ll" + "c" * len(columns) + "}", r"\toprule",
           "method & $\\varepsilon$ & " + " & ".join(columns) + r" \\", r"\midrule"]
    for m, e in rows:
        md_cells, tex_cells = [], []
        for d in columns:
            key, text = (m, e, d), texts.get((m, e, d), "")
            md_cells.append(f"**{text}**" if key in best else text)
            tex_text = text.replace("±", r"$\pm$").replace("–", "--")
            tex_cells.append(rf"\textbf{{{tex_text}}}" if key in best else tex_text)
        md.append(f"| {m} | {e} | " + " | ".join(md_cells) + " |")
        tex.append(f"{m} & {e} & " + " & ".join(tex_cells) + r" \\")
    tex += [r"\bottomrule", r"\end{tabular}"]
    md += memory_table(summaries)
    if compare:
        md += ["", "[In brackets]: the published number for the same method, ε and data set, from: "
               + ("; ".join(sources) if sources else "no matching table") + "."]
    if chosen:
        md += ["", "Each cell is one run: the best final metric of the three with the lowest final training loss "
               "(--select top3):", ""] + [f"- {line}" for line in chosen]
    if searched:
        md += ["", "The privacy of releasing a result chosen among these runs (see README, Reports):", ""] + \
            [f"- {line}" for line in searched]
    left = unfinished(summaries, missing) + repeats
    if left:
        md += ["", f"Not in the table ({len(left)}):", ""] + [f"- {line}" for line in left]
    with open(out / "report.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "epsilon", "data", "metric", "n", "mean", "se", "oom", "best_private", "cell"])
        for key in sorted(table_cells, key=lambda k: (k[0], _epsilon_order(k[1]), k[2])):
            c = table_cells[key]
            w.writerow([*key, c["metric"], c["n"], c["mean"], c["se"], c["oom"], key in best, texts[key]])
    drawn = figures.write(out, summaries, table_cells)
    if drawn:
        md += ["", "Figures: " + ", ".join(f for f in drawn if f.endswith(".png")) + " (and PDF)."]
    text = "\n".join(md) + "\n"
    (out / "report.md").write_text(text)
    (out / "report.tex").write_text("\n".join(tex) + "\n")
    return text
