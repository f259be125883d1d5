"""`dpmem report PATH...`: every run's summary.json under the given folders as the papers' tables.

Rows are method × ε (and, within a method, the settings that differ between its runs, such as a swept
method.subspace.k), columns are tasks (data sets); a cell is the final metric's mean ± standard error over seeds,
in percent (accuracy, F1, EM, ROUGE-1 are fractions in the summaries). A cell whose runs ran out of memory says OOM;
the best private result of each column is marked (bold in markdown, \\textbf in LaTeX). Runs that did not finish
ok (failed, interrupted, still running or dead with status running), run folders with no summary and repeats of
a run (the same configuration and seed) are listed, never silently dropped or counted twice. Folders of an analysis
(`dpmem spectrum`, `dpmem audit`) are no results: they are listed apart. Under the table, the ε of releasing a
result chosen among the runs composes every release on its data (`search_privacy`). Written as report.md,
report.csv (one line per cell) and report.tex, with the figures of `dpmem.report.figures`."""

from __future__ import annotations

import csv
import functools
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf

from dpmem.data import is_loss
from dpmem.engine.summary import PRIVACY_LEDGER, most_spent, privacy_records
from dpmem.report import figures
from dpmem.report.labels import NOT_TRAINING, row_label, variants

OK = "ok"


REQUIRED = ("status", "method", "data")  # what a row needs; every other field a summary may lack (older versions)


def collect(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """Every readable summary under `paths`, and a record {run_dir, why} for each run folder that has none or an
    unreadable one: those are listed under the table, and the report goes on. Both carry the folder's flattened
    config.yaml (`config`), its privacy.jsonl lines (`ledger`: what every attempt released, summary or not) and
    which analysis wrote the folder, if one did (`analysis`)."""
    summaries, missing = [], []
    seen: set[Path] = set()  # a folder under two of the paths (the same path twice, or one inside another) once
    for root in paths:
        root = Path(root)
        if not root.exists():
            raise FileNotFoundError(f"{root} does not exist")
        for f in sorted(root.rglob("summary.json")):
            if f.parent.resolve() in seen:
                continue
            seen.add(f.parent.resolve())
            try:
                s = json.loads(f.read_text())
                lacking = [k for k in REQUIRED if k not in s] if isinstance(s, dict) else ["(not a JSON object)"]
            except (ValueError, OSError) as e:
                missing.append(_folder(f.parent, {"why": f"unreadable summary.json ({type(e).__name__}: "
                                                         f"{str(e)[:80]})" + _ledger_note(f.parent)}))
                continue
            if lacking:
                missing.append(_folder(f.parent, {"why": f"summary.json lacks {', '.join(lacking)}"
                                                         + _ledger_note(f.parent)}))
                continue
            summaries.append(_folder(f.parent, s))
        folders = {c.parent for c in root.rglob("config.yaml") if c.parent.name != ".hydra"}
        folders |= {c.parent for c in root.rglob(PRIVACY_LEDGER)}
        for folder in sorted(folders):
            # dpmem audit's own folder holds its config and record; the audited run, in run/, has the summary (an
            # audit's folder with a ledger of its own holds a training run it was written over: listed, composed)
            if folder.resolve() in seen:
                continue
            seen.add(folder.resolve())
            audit_only = (folder / "audit.json").exists() and not (folder / PRIVACY_LEDGER).exists()
            if not (folder / "summary.json").exists() and not audit_only:
                note = _ledger_note(folder)
                missing.append(_folder(folder, {"why": "no summary.json"
                                                       + (note or " (the run died before it started)")}))
    return summaries, missing


def _folder(folder: Path, record: dict) -> dict:
    config = folder / "config.yaml"
    try:
        tree = OmegaConf.to_container(OmegaConf.load(config)) if config.is_file() else {}
    except Exception as e:  # noqa: BLE001  (not YAML, not a mapping: yaml's and OmegaConf's errors alike)
        print(f"dpmem: warning: {config} is unreadable ({type(e).__name__}): the run is tabulated by its summary "
              "alone", file=sys.stderr)
        tree = {}
    record.update(run_dir=str(folder), ledger=privacy_records(folder),
                  config=_flat(tree) if isinstance(tree, dict) else {})
    record["analysis"] = record.get("analysis") or _analysis(folder)
    return record


def _analysis(folder: Path) -> str | None:
    """The analysis that wrote a folder whose summary does not say so (written by an older dpmem), told by the
    files it leaves: spectrum.json or recorded gradients (`dpmem spectrum`), audit.json beside the run
    (`dpmem audit` trains in AUDIT/run); or by the mark those verbs write first (dpmem.engine.folder.MARK)."""
    from dpmem.engine.folder import MARK

    for where in (folder, folder.parent):
        try:
            mark = (where / MARK).read_text().strip()
        except OSError:
            continue
        if mark in ("spectrum", "audit", "memory") and (where == folder or (mark == "audit" and folder.name == "run")):
            return mark
    if (folder / "spectrum.json").exists() or (folder / "gradients" / "index.json").exists():
        return "spectrum"
    if (folder.parent / "audit.json").exists():
        return "audit"
    return None


def _analysis_run(folder: dict) -> bool:
    """Whether a folder is an analysis's own training run (dpmem audit's AUDIT/run), not a run it wrote over."""
    path = Path(folder["run_dir"])
    return path.name == "run" and _analysis(path) == "audit"


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
    train nothing different. An ok run is kept before one that is not. The table's sample only: a private repeat
    whose noise and batches came from the OS is a release of its own (`search_privacy` composes it)."""
    kept: dict[str, dict] = {}
    repeats = []
    for s in sorted(summaries, key=lambda s: (s["status"] != OK, s["run_dir"])):
        key = _configuration(s)
        if key is None:  # without its config.yaml, a run cannot be told to be another's repeat
            kept[s["run_dir"]] = s
            continue
        if key in kept:
            why = s.get("privacy_ignored") or (
                None if not s.get("sigma") else "seeded: composed into no ε" if seeded(s) else
                "its noise and batches drawn afresh: a release of its own, composed below")
            repeats.append(f"{s['run_dir']}: the same configuration and seed as {kept[key]['run_dir']}, counted once "
                           "in the table" + (f" ({why})" if why else ""))
        else:
            kept[key] = s
    chosen = {id(s) for s in kept.values()}
    return [s for s in summaries if id(s) in chosen], repeats


def _configuration(s: dict) -> str | None:
    """What a run trained, as a key (None without its config.yaml): its configuration less how it was started
    and recorded; a run without noise trains the same under any privacy options."""
    config = s["config"]
    if "train.seed" not in config:
        return None
    return json.dumps({k: v for k, v in config.items() if not k.startswith(NOT_TRAINING)
                       and not (k.startswith("privacy.") and not s.get("sigma"))}, sort_keys=True, default=str)


def _flat(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


SEEDED = "∞ to a holder of config.yaml"
SEEDS = (("batches", "sampler_seed"), ("noise", "noise_seed"))  # what a privacy seed in config.yaml derives


def seeded(s: dict) -> list[str]:
    """What of a private run its config.yaml derives (batches: privacy.sampler_seed; noise: privacy.noise_seed):
    anyone holding that file replays it, and against them its ε is ∞. Empty for a run whose draws the OS keyed."""
    if s.get("epsilon_target") is None or not s.get("private", True):
        return []
    if s.get("derivable_from_config") is not None:
        return list(s["derivable_from_config"])
    return [what for what, key in SEEDS if s["config"].get(f"privacy.{key}") is not None]


def _epsilon(s: dict) -> str:
    """The row's ε: non-private for non-private methods, noise-free runs and runs that leak (epsilon_spent inf);
    for a seeded private run, ∞ to a holder of its config.yaml (`seeded`)."""
    eps = s.get("epsilon_target")
    if eps is None or not s.get("private", True):
        return "non-private"
    return SEEDED if seeded(s) else f"{eps:g}"


def data_column(summaries: list[dict]):
    """A run's column: its data set's name, and its data.path where runs of that name read several files (runs on
    different files are not seeds of one cell)."""
    paths = defaultdict(set)
    for s in summaries:
        paths[s["data"]].add(s["config"].get("data.path"))

    def column(s: dict) -> str:
        path = s["config"].get("data.path")
        return f"{s['data']} ({path})" if len(paths[s["data"]]) > 1 else s["data"]
    return column


def cells(summaries: list[dict]) -> dict[tuple[str, str, str], dict]:
    """(method, ε, data) -> {values (final metric of each ok run), n, mean, se, oom, metric}."""
    variants(summaries)
    column = data_column(summaries)
    grouped: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for s in summaries:
        grouped[(row_label(s), _epsilon(s), column(s))].append(s)
    out = {}
    for key, runs in grouped.items():
        values = [r["metric_final"] for r in runs if r["status"] == OK and r.get("metric_final") is not None]
        n = len(values)
        mean = statistics.fmean(values) if n else None
        se = statistics.stdev(values) / math.sqrt(n) if n > 1 else None
        out[key] = {"values": values, "n": n, "mean": mean, "se": se,
                    "oom": any(r["status"] == "oom" for r in runs),
                    "private": key[1] not in ("non-private", SEEDED),
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
    return math.inf if eps in ("non-private", SEEDED) else float(eps)


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


# what an older ledger's lines lack, taken from the folder's summary
LATER_FIELDS = ("sampling", "dataset_size", "neighbouring")


def releases(folder: dict) -> list[dict]:
    """What a run folder released on its training data, one dict per release: each start in its privacy.jsonl with
    the resumes after it (a resume redraws the same batches and noise for the steps it redoes), the last one the
    folder's run and any earlier one an attempt abandoned with train.overwrite=true, which no summary shows; a
    folder without a ledger (a run without noise, an older dpmem) is its summary's run. Each holds what composing it
    needs (sigma: the noise multiplier accounted per step; steps: the most any line, or the summary, recorded), its
    epsilon, and whether it was abandoned."""
    s = folder  # a summary, or a folder without one ({run_dir, why, config, ledger})
    summary = {k: v for k, v in {
        "steps_done": s.get("steps_done"), "epsilon": s.get("epsilon_spent"), "sigma": s.get("sigma"),
        "sigma_accounted": s.get("sigma_accounted"), "sample_rate": s.get("sample_rate"),
        "accountant": s.get("accountant"), "delta": s.get("delta"), "sampling": s.get("sampling"),
        "dataset_size": s.get("n_train"),
        "neighbouring": s.get("neighbouring") or s["config"].get("privacy.neighbouring"),
    }.items() if v is not None}
    attempts: list[list[dict]] = []
    for line in s["ledger"]:
        if (not attempts or line.get("event") == "start"
                or (line.get("attempt") != attempts[-1][-1].get("attempt") and line.get("event") != "resume")):
            attempts.append([])
        attempts[-1].append(line)
    attempts = attempts or [[]]
    out = []
    for i, lines in enumerate(attempts):
        last = i == len(attempts) - 1
        lines = lines + [summary] if last else lines  # the summary is the last run's, maybe past its last line
        known = {k: summary[k] for k in LATER_FIELDS if k in summary}
        for line in lines:
            known.update((k, v) for k, v in line.items() if v is not None)
        spent = [float(line["epsilon"]) for line in lines if line.get("epsilon") is not None]
        out.append({"sigma": float(known.get("sigma_accounted", known.get("sigma", 0.0))),
                    "sample_rate": known.get("sample_rate"), "sampling": known.get("sampling", "poisson"),
                    "steps": max((int(line.get("steps_done") or 0) for line in lines), default=0),
                    "dataset_size": known.get("dataset_size"), "accountant": known.get("accountant"),
                    "neighbouring": known.get("neighbouring", "add_remove"), "delta": known.get("delta"),
                    "epsilon": max(spent, default=math.inf), "abandoned": not last})
    return out


def _noised(release: dict) -> bool:
    return bool(release["accountant"]) and release["sigma"] > 0 and math.isfinite(release["epsilon"])


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def search_privacy(folders: list[dict]) -> list[str]:
    """A line per data set with several private releases: choosing and releasing a result among the runs (a
    search, a grid, a table) releases every one of them, so its ε is their mechanisms composed (dp-accounting, at
    the largest δ). Every release counts (`releases`): each run, a repeat whose noise and batches the OS drew,
    each attempt abandoned with train.overwrite=true, and folders whose summary is lost. A seeded run (`seeded`)
    is composed into no ε: against a holder of its config.yaml it has none. Runs count as touching the same data
    when they share data.name and data.path, whatever examples each drew: the conservative reading."""
    from dpmem.privacy import composed_epsilon
    groups = defaultdict(list)
    for f in folders:
        data = f.get("data") or f["config"].get("data.name")
        if data is not None:  # a folder with neither summary nor config is listed with its ledger's ε
            groups[(data, f["config"].get("data.path"))].append(f)
    lines = []
    for (data, path), group in sorted(groups.items(), key=str):
        derivable = [f for f in group if seeded(f)]
        if derivable:  # replayable by whoever holds their config.yaml: no ε composes them (`seeded_runs` lists them)
            lines.append(f"{data + (f' ({path})' if path else '')}: {_count(len(derivable), 'seeded run')} not "
                         "composed here: ε ∞ to a holder of their config.yaml (listed below)")
            groups[(data, path)] = [f for f in group if not seeded(f)]
    for (data, path), group in sorted(groups.items(), key=str):
        made = [r for f in group for r in releases(f) if r["steps"]]
        accounted = list(filter(_noised, made))
        if len(accounted) < 2:
            continue
        name = data + (f" ({path})" if path else "")
        if all(f.get("data_public", f["config"].get("data.public")) for f in group):
            lines.append(f"{name}: {len(group)} runs on data declared public (data.public=true), a proxy: searching "
                         "there spends nothing of a private data set's budget")
            continue
        abandoned = sum(r["abandoned"] for r in accounted)
        loose = len(made) - len(accounted)
        head = (f"{name}: {len(accounted)} private releases on the same training data ("
                + _count(len(accounted) - abandoned, "run") + (f" + {_count(abandoned, 'abandoned attempt')}"
                                                                 if abandoned else "")
                + f"), each ε ≤ {max(r['epsilon'] for r in accounted):.3g}; ")
        accountants = {(r["accountant"], r["neighbouring"]) for r in accounted}
        delta = max(r["delta"] for r in accounted)
        if len(accountants) > 1 or ("rc", "add_remove") in accountants:
            lines.append(head + "their composition is not computed here (rc, or several accountants)")
            continue
        accountant, neighbouring = accountants.pop()
        try:
            composed = composed_epsilon(accounted, delta, accountant, neighbouring)
        except ValueError as e:  # what an older ledger does not record (the data set's size for fixed sampling)
            lines.append(head + f"their composition is not computed here ({e})")
            continue
        lines.append(head + f"releasing a result chosen among them releases all: ε = {composed:.4g} at δ = "
                     f"{delta:.2g} ({accountant}, composed)" + (f"; {_count(loose, 'more release')} outside any ε "
                                                                 "(no noise, or a leak)" if loose else ""))
    return lines


def seeded_runs(summaries: list[dict]) -> list[str]:
    """A line per private run whose noise or batches its config.yaml derives (`seeded`): never best private, never
    composed into a search's ε."""
    lines = []
    for s in summaries:
        if what := seeded(s):
            keys = " and ".join(f"privacy.{k}" for w, k in SEEDS if w in what)
            lines.append(f"{s['run_dir']}: its {' and '.join(what)} derive from {keys} in its config.yaml: ε ∞ to "
                         "whoever holds that file (for debugging and tests, not a release)")
    return lines


def selections(folders: list[dict]) -> list[str]:
    """A line per private search (hydra/sweeper=private, dpmem.engine.selection) among the folders' sweeps: what
    its selection.json releases and at what ε, beside `search_privacy`'s composition of every trial."""
    lines = []
    for path in sorted({Path(f["run_dir"]).parent / "selection.json" for f in folders}):
        if not path.exists():
            continue
        try:
            s = json.loads(path.read_text())
            lines.append(f"{path.parent}: {s['ended']}; release only {s['winner'] or 'nothing'}, at ε = "
                         f"{s['epsilon']:.4g} and δ = {s['delta']:.2g} for the whole search ({s['accountant']}; the "
                         f"number of trials secret, {s['law']} of mean {s['mean_trials']:g}). Publishing any other "
                         "of its trials too costs every release composed (above)")
        except (OSError, ValueError, KeyError, TypeError) as e:
            lines.append(f"{path.parent}: unreadable selection.json ({type(e).__name__}); its trials count as composed")
    return lines


def analyses(folders: list[dict]) -> list[str]:
    """A line per folder an analysis wrote (`dpmem spectrum`, `dpmem audit`): what covers what it holds. None is a
    result, and none is composed with the training runs (no result is chosen among them): publishing what one
    holds is a release of its own."""
    lines = []
    for f in folders:
        what = f"{f['run_dir']}: dpmem {f['analysis']}" + (f" ({f['method']} on {f['data']})" if "method" in f else "")
        if f["analysis"] == "spectrum" or f.get("private") is False:
            lines.append(f"{what}, not private: {_not_private_because(f)}")
        elif f.get("epsilon_spent") is not None:
            lines.append(f"{what}, ε {float(f['epsilon_spent']):.3g} of its own")
        else:
            lines.append(f"{what}: {f['why']}")
    return lines


def _not_private_because(f: dict) -> str:
    why = f.get("not_private_because")
    spectrum = Path(f["run_dir"]) / "spectrum.json"
    if why is None and spectrum.exists():
        why = json.loads(spectrum.read_text()).get("not_private_because")
    return why or "it holds statistics of the training data's gradients measured outside the run's noise (a folder " \
                  "of an older dpmem spectrum)"


def unfinished(summaries: list[dict], missing: list[dict]) -> list[str]:
    lines = [f"{s['run_dir']}: {s['status']}" + (f" ({s['error']})" if s.get("error") else "")
             + f", {s.get('steps_done')}/{s.get('steps')} steps" for s in summaries if s["status"] not in (OK, "oom")]
    lines += [f"{m['run_dir']}: {m['why']}" for m in missing]
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
    column = data_column(summaries)
    for s in summaries:
        if s["status"] == OK and s.get("train_loss") is not None and s.get("metric_final") is not None:
            groups[(s["method"], _epsilon(s), column(s))].append(s)
    chosen, lines = [], []
    for (method, eps, data), runs in sorted(groups.items()):
        three = sorted(runs, key=lambda r: r["train_loss"])[:3]
        best = (min if is_loss(three[0].get("metric_name")) else max)(three, key=lambda r: r["metric_final"])
        chosen.append(best)
        lines.append(f"{method}, ε {eps}, {data}: {best['run_dir']} (training loss {best['train_loss']:.4g}, "
                     f"{len(runs)} runs)")
    return chosen, lines


def write(out: Path, summaries: list[dict], missing: list[dict], compare: bool = False,
          select: str | None = None) -> str:
    """report.md, report.csv and report.tex in `out` from `collect`'s summaries and folders without one (with
    `compare`, the papers' numbers in brackets; with `select="top3"`, one run per method, ε and data set:
    `top_three`); returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    analysed = [f for f in summaries + missing if f["analysis"]]
    summaries = [s for s in summaries if not s["analysis"]]
    missing = [m for m in missing if not m["analysis"]]
    # every release counts, whichever run is shown, and whatever verb wrote into its folder last: an analysis
    # written over a training run (train.overwrite=true) leaves that run's ledger, whose releases are composed
    overwritten = [f for f in analysed if "status" not in f and f["ledger"] and not _analysis_run(f)]
    searched = search_privacy(summaries + missing + overwritten)
    summaries, repeats = distinct(summaries)
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
        md += ["", "The privacy of releasing a result chosen among these runs (docs/privacy.md, Searching on "
               "private data):", ""] + [f"- {line}" for line in searched]
    derivable = seeded_runs(summaries)
    if derivable:
        md += ["", f"Seeded runs ({len(derivable)}; in the table at ε {SEEDED}, never best private, composed into no "
               "ε):", ""] + [f"- {line}" for line in derivable]
    selected = selections(summaries + missing)
    if selected:
        md += ["", "Private selections (docs/privacy.md, Private selection):", ""] + [f"- {line}" for line in selected]
    left = unfinished(summaries, missing) + repeats
    if left:
        md += ["", f"Not in the table ({len(left)}):", ""] + [f"- {line}" for line in left]
    if analysed:
        md += ["", f"Folders of an analysis, not results ({len(analysed)}; neither in the table nor composed with the "
               "runs above):", ""] + [f"- {line}" for line in analyses(analysed)]
    with open(out / "report.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "epsilon", "data", "metric", "n", "mean", "se", "oom", "best_private",
                    "derivable_from_config", "cell"])
        for key in sorted(table_cells, key=lambda k: (k[0], _epsilon_order(k[1]), k[2])):
            c = table_cells[key]
            w.writerow([*key, c["metric"], c["n"], c["mean"], c["se"], c["oom"], key in best, key[1] == SEEDED,
                        texts[key]])
    drawn = figures.write(out, summaries, table_cells)
    if drawn:
        md += ["", "Figures: " + ", ".join(f for f in drawn if f.endswith(".png")) + " (and PDF)."]
    text = "\n".join(md) + "\n"
    (out / "report.md").write_text(text)
    (out / "report.tex").write_text("\n".join(tex) + "\n")
    return text
