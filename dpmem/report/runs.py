"""`dpmem report PATH...`: every run's summary.json under the given folders as the papers' tables (method × ε by
data set, the final metric's mean ± standard error over seeds, the best private result marked), and under them what
the table leaves out, never silently dropped or counted twice (runs not ok or without a summary, repeats, analyses),
and the privacy of choosing among the runs (`search_privacy`). Writes report.md, report.csv (one line per cell),
report.tex and `dpmem.report.figures`; what each part shows: docs/getting-started.md, A report."""

from __future__ import annotations

import csv
import functools
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import OmegaConf

from dpmem.data import is_loss
from dpmem.engine.folder import MARK
from dpmem.engine.summary import METRICS, PRIVACY_LEDGER, most_spent, privacy_records
from dpmem.privacy.accounting import Event
from dpmem.privacy.record import PrivacyUnit, line_epsilon, summary_line
from dpmem.report import figures, markdown_table
from dpmem.report.labels import NOT_TRAINING, USER, epsilon_number, row_label, variants

OK = "ok"
REQUIRED = ("status", "method", "data")  # what a row needs; every other field a summary may lack (older versions)


def collect(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """Every readable summary under `paths`, and a record {run_dir, why} for each run folder that has none or an
    unreadable one: those are listed under the table, and the report goes on. Both carry the folder's flattened
    config.yaml (`config`), its privacy.jsonl lines (`ledger`: what every attempt released, summary or not) and
    which analysis wrote the folder, if one did (`analysis`)."""
    summaries, missing = [], []
    seen: set[Path] = set()  # a folder under two of the paths (the same path twice, or one inside another) once
    for root in map(Path, paths):
        if not root.exists():
            raise FileNotFoundError(f"{root} does not exist")
        # folders with a summary first, then those without one: a config.yaml or a ledger but no summary.json
        others = {c.parent for c in root.rglob("config.yaml") if c.parent.name != ".hydra"}
        others |= {c.parent for c in root.rglob(PRIVACY_LEDGER)}
        for folder in [f.parent for f in sorted(root.rglob("summary.json"))] + sorted(others):
            if folder.resolve() in seen:
                continue
            seen.add(folder.resolve())
            if (folder / "summary.json").exists():
                try:
                    s = json.loads((folder / "summary.json").read_text())
                    lacking = [k for k in REQUIRED if k not in s] if isinstance(s, dict) else ["(not a JSON object)"]
                    why = f"summary.json lacks {', '.join(lacking)}" if lacking else None
                except (ValueError, OSError) as e:
                    why = f"unreadable summary.json ({type(e).__name__}: {str(e)[:80]})"
                if why is None:
                    summaries.append(_folder(folder, s))
                else:
                    record = _folder(folder, {})
                    record["why"] = why + (_ledger_note(record) or _files_note(record))
                    missing.append(record)
            # dpmem audit's own folder holds its config and record; the audited run, in run/, has the summary (an
            # audit's folder with a ledger of its own holds a training run it was written over: listed, composed)
            elif not (folder / "audit.json").exists() or (folder / PRIVACY_LEDGER).exists():
                record = _folder(folder, {})
                note = _ledger_note(record) or _files_note(record) or " (the run died before it started)"
                record["why"] = "no summary.json" + note
                missing.append(record)
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


def _ledger_note(folder: dict) -> str:
    """What the folder's privacy.jsonl says was spent, for a run whose summary cannot be read: its ε, and beside it,
    where it is less, the ε its config.yaml (or, without one, its lines' own σ and q) gives for those steps, which
    an edit of the ledger does not lower."""
    records = folder["ledger"]
    if (spent := most_spent(records)) is None:
        return ""
    steps = max(int(r.get("steps_done") or 0) for r in records)
    note = f"; its {PRIVACY_LEDGER} records epsilon {spent:.4g} spent over {steps} steps"
    again, source = _recomputed(folder, steps)
    if again > spent * (1 + 1e-6):
        note += (f", which disagrees with the epsilon {again:.4g} {source} give for those steps: it spent at least "
                 f"{again:.4g}")
    return note


def _recomputed(folder: dict, steps: int) -> tuple[float, str]:
    """The least ε a folder's run spent over `steps` steps, whatever its ledger's ε fields say, and what gave it: its
    config.yaml's σ and q (`_planned`; σ no larger and q no smaller than a line says), or its lines' own (each
    line's σ, q and steps, `line_epsilon`) where no config.yaml says; 0 where neither can."""
    lines = folder["ledger"]
    furthest = [r for r in lines if int(r.get("steps_done") or 0) == steps]
    own = max((eps for r in furthest if (eps := line_epsilon(r)) is not None), default=0.0)
    planned = _planned(folder) if steps else None
    if not isinstance(planned, Planned):
        return own, f"its {PRIVACY_LEDGER} lines' own σ and q"
    sigma = min([planned.event.sigma, *(float(r.get("sigma_accounted") or r["sigma"]) for r in lines
                                        if r.get("sigma"))])
    rate = max([planned.event.sample_rate, *(float(r["sample_rate"]) for r in lines if r.get("sample_rate"))])
    try:
        again = replace(planned.event, sigma=sigma, sample_rate=rate).epsilon(steps)
        return max(own, again), f"its config.yaml's σ {sigma:.4g} and q {rate:.4g}"
    except (TypeError, ValueError):  # a line's σ or q that cannot be accounted: its own lines' ε stands
        return own, f"its {PRIVACY_LEDGER} lines' own σ and q"


def _files_note(folder: dict) -> str:
    """For a run folder with neither summary nor ledger: how far its other files show the run went (metrics.jsonl's
    last step, checkpoint.pt's), and the ε its config.yaml gives over the steps it plans (no record is left that
    says fewer were released: `releases` composes it so); "" where they show no step."""
    from dpmem.engine.folder import written_checkpoint

    run_dir = Path(folder["run_dir"])
    if (run_dir / PRIVACY_LEDGER).exists():
        return ""
    shown = {}
    if (metrics := _last_metrics_step(run_dir)) is not None:
        shown[f"{METRICS} to step {metrics}"] = metrics
    if (state := written_checkpoint(run_dir)) is not None:
        shown[f"checkpoint.pt at step {state['step']}"] = state["step"]
        folder.update({k: state["summary"][k] for k in ("n_train", "users") if k in state["summary"]})
    if not shown:
        return ""
    folder["steps_shown"] = max(shown.values())
    planned = _planned(folder)
    steps = f"{folder['steps_shown']}/{planned.steps if isinstance(planned, Planned) else '?'} steps"
    note = f"; no {PRIVACY_LEDGER} either, but its files show the run went on (it died or runs): {steps} " \
           f"({', '.join(shown)})"
    if not isinstance(planned, Planned):
        return note + (f"; its epsilon cannot be computed here: {planned}" if planned else "")
    (release,), _ = releases(folder)
    return note + (f"; epsilon {release.epsilon:.4g} by its config.yaml's σ and q over the {release.steps} "
                   "steps it plans (no record is left that says fewer were released)")


def _last_metrics_step(run_dir: Path) -> int | None:
    """The last step metrics.jsonl records (its readable lines'), or None."""
    try:
        raw = (run_dir / METRICS).read_bytes()
    except OSError:
        return None
    steps = []
    for line in raw.split(b"\n"):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and not isinstance(step, bool) and step > 0:
            steps.append(step)
    return max(steps, default=None)


def distinct(summaries: list[dict]) -> tuple[list[dict], list[str]]:
    """One run per configuration and seed, and a line for each run left out: two runs that train the same thing
    are one sample, not two seeds. The privacy options of a run without noise (adam under privacy=eps2 and eps8)
    train nothing different. An ok run is kept before one that is not. The table's sample only: a private repeat
    whose noise and batches came from the OS is a release of its own (`search_privacy` composes it)."""
    kept: dict[str, dict] = {}
    repeats = []
    for s in sorted(summaries, key=lambda s: (s["status"] != OK, s["run_dir"])):
        # what it trained, less how it was started and recorded; without its config.yaml, a run is no other's repeat
        key = s["run_dir"] if "train.seed" not in s["config"] else json.dumps(
            {k: v for k, v in s["config"].items() if not k.startswith(NOT_TRAINING)
             and not (k.startswith("privacy.") and not s.get("sigma"))}, sort_keys=True, default=str)
        if key not in kept:
            kept[key] = s
            continue
        why = s.get("privacy_ignored") or (
            None if not s.get("sigma") else "seeded: composed into no ε" if seeded(s) else
            "its noise and batches drawn afresh: a release of its own, composed below")
        repeats.append(f"{s['run_dir']}: the same configuration and seed as {kept[key]['run_dir']}, counted once "
                       "in the table" + (f" ({why})" if why else ""))
    chosen = {id(s) for s in kept.values()}
    return [s for s in summaries if id(s) in chosen], repeats


def _flat(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    return {key: v for k, sub in tree.items() for key, v in _flat(sub, f"{prefix}{k}.").items()}


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
    for a seeded private run, ∞ to a holder of its config.yaml (`seeded`); a fixed σ's with its σ."""
    eps = s.get("epsilon_target")
    if eps is None or not s.get("private", True):
        return "non-private"
    if seeded(s):
        return SEEDED
    fixed = s["config"].get("privacy.noise_multiplier")  # σ given: its ε over the planned steps, and σ
    return (f"{eps:.3g} (σ {fixed:g})" if fixed is not None else f"{eps:g}") + (USER if unit_of(s) == "user" else "")


def unit_of(s: dict) -> str:
    """What a run's ε protects: user where its config.yaml (privacy.unit) and what it wrote (its summary, its
    ledger) all say so (`unit_claims`), else record: a record-level run whose files were edited to claim more is not
    shown as protecting users."""
    claims = unit_claims(s)
    return "user" if len(claims) > 1 and set(claims.values()) == {"user"} else "record"


def unit_claims(s: dict) -> dict[str, str]:
    """What each of a run's files says its ε protects, user or record: config.yaml's privacy.unit (record where it
    has none), and where they say, its summary's unit and its ledger's (the lines of its last configuration, record
    where any says record)."""
    claims = {"config.yaml": str(s.get("config", {}).get("privacy.unit") or "record")}
    if s.get("unit"):
        claims["summary.json"] = str(s["unit"])
    lines = s.get("ledger", ())
    last = next((line["config"] for line in reversed(lines) if line.get("config")), None)
    if units := {str(line["unit"]) for line in lines if line.get("unit") and line.get("config", last) == last}:
        claims[PRIVACY_LEDGER] = "user" if units == {"user"} else "record"
    return claims


def _unit_note(s: dict) -> str | None:
    """The line for a run whose files disagree on what its ε protects: the weaker claim, record, is taken."""
    claims = unit_claims(s)
    if len(set(claims.values())) < 2:
        return None
    def say(unit: str) -> str:
        files = [f for f, u in claims.items() if u == unit]
        return " and ".join(files) + (" says" if len(files) == 1 else " say") + f" unit {unit}"
    return (f"{s['run_dir']}: {say('user')} where {say('record')}: its ε is shown and composed per record, the "
            "weaker claim")


def data_column(summaries: list[dict]):
    """A run's column: its data set's name, and its data.path where runs of that name read several files (runs on
    different files are not seeds of one cell)."""
    paths = defaultdict(set)
    for s in summaries:
        paths[s["data"]].add(s["config"].get("data.path"))

    def column(s: dict) -> str:
        return f"{s['data']} ({s['config'].get('data.path')})" if len(paths[s["data"]]) > 1 else s["data"]
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
        out[key] = {"values": values, "n": n, "mean": statistics.fmean(values) if n else None,
                    "se": statistics.stdev(values) / math.sqrt(n) if n > 1 else None,
                    "oom": any(r["status"] == "oom" for r in runs),
                    "private": key[1] not in ("non-private", SEEDED),
                    "paper": {_paper_key(r) for r in runs},
                    "metric": runs[0].get("metric_name")}
    return out


def _text(cell: dict) -> str:
    if cell["n"] == 0:
        return "OOM" if cell["oom"] else "–"
    # summaries hold fractions (accuracy, F1, EM, ROUGE-1), shown in percent; losses as they are
    scale, mean, se = (1, ".4g", ".2g") if is_loss(cell["metric"]) else (100, ".1f", ".1f")
    return f"{scale * cell['mean']:{mean}}" + (f" ± {scale * cell['se']:{se}}" if cell["se"] is not None else "")


def _natural(label: str) -> list:
    """A row label's sort key with its numbers as numbers (dimension=3000 before dimension=10000)."""
    return [(0, float(part), "") if part.replace(".", "", 1).isdigit() else (1, 0.0, part)
            for part in re.split(r"(\d+(?:\.\d+)?)", label)]


def _epsilon_order(eps: str) -> tuple[float, bool]:
    return ((math.inf, False) if eps in ("non-private", SEEDED)
            else (epsilon_number(eps), eps.endswith(USER)))


def table(table_cells: dict) -> tuple[list[str], list[tuple[str, str]], dict, set]:
    """Columns (tasks), rows (method, ε), cell texts and the best private cell per column."""
    columns = sorted({d for _, _, d in table_cells})
    rows = sorted({(m, e) for m, e, _ in table_cells}, key=lambda r: (_natural(r[0]), _epsilon_order(r[1])))
    score = {k: -c["mean"] if is_loss(c["metric"]) else c["mean"]  # the higher the better
             for k, c in table_cells.items() if c["private"] and c["n"]}
    best = {k for k, v in score.items() if v == max(w for j, w in score.items() if j[2] == k[2])}
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
    rows = [[method, str(model), *(f"{v[b]:.1f}" if b in v else "" for b in batches)]
            for (method, model), v in sorted(peaks.items(), key=lambda kv: max(kv[1].values()))]
    return ["", f"Peak memory (MiB, {', '.join(sources)}) against the physical batch size:", "",
            *markdown_table(["method", "model", *map(str, batches)], rows)]


@dataclass(frozen=True)
class Release:
    """What a run folder released once on its training data: its event (as its ledger accounts it,
    `Event.as_accounted`), the steps it ran, its ε, and whether an overwrite abandoned it (no summary shows it)."""
    event: Event
    steps: int
    epsilon: float
    abandoned: bool = False

    @property
    def composable(self) -> bool:
        """Accounted with noise, and to a finite ε: what a search's composition (`search_privacy`) takes."""
        return bool(self.event.accountant) and self.steps > 0 and self.event.sigma > 0 and math.isfinite(self.epsilon)


@dataclass(frozen=True)
class Planned:
    """What a private run's config.yaml implies for its releases (`_planned`): its event as its ledger accounts it,
    of the σ the run calibrated (or was given), the steps it plans, and its `config_hash`."""
    event: Event
    steps: int
    config: str


def releases(folder: dict) -> tuple[list[Release], str | None]:
    """What a run folder released on its training data: each start in its privacy.jsonl with the resumes after it
    (a resume redraws the same batches and noise for the steps it redoes), the last one the folder's run and any
    earlier one an attempt abandoned with train.overwrite=true; a folder without a ledger (a run without noise, an
    older dpmem) is its summary's run. A release of the configuration its config.yaml records (the folder's run,
    and an abandoned attempt whose lines name that configuration) is taken at the conservative end of what its
    lines and that configuration say (`_conservative`), so that no edit of the ledger or the summary lowers its ε.
    Returns the releases and the one line that says where the config's was taken over the lines', or that the
    lines were taken as written; None where there is nothing to say."""
    s = folder  # a summary, or a folder without one ({run_dir, why, config, ledger})
    summary = summary_line(s)  # what an older ledger's lines lack, and the last attempt's last word
    if not summary.get("neighbouring") and s["config"].get("privacy.neighbouring"):
        summary["neighbouring"] = s["config"]["privacy.neighbouring"]
    attempts = _attempts(s["ledger"], summary)
    # (a folder with neither ledger nor summary released nothing, unless its other files show steps run: its
    # config.yaml is not read)
    planned = _planned(s) if s["ledger"] or "status" in s or s.get("steps_shown") else None
    out, said, as_written = [], {}, 0
    for i, lines in enumerate(attempts):
        abandoned = i < len(attempts) - 1
        steps = max((int(line.get("steps_done") or 0) for line in lines), default=0)
        spent = [float(line["epsilon"]) for line in lines if line.get("epsilon") is not None]
        # the folder's run is its config.yaml's; an abandoned attempt is where its lines name no other configuration
        if not isinstance(planned, Planned) or (abandoned and not {line["config"] for line in lines
                                                                   if line.get("config")} <= {planned.config}):
            out.append(Release(Event.from_lines(lines, summary), steps, max(spent, default=math.inf), abandoned))
            as_written += 1
            continue
        # the steps it plans: no line lowers them; the folder's summary may (a run that failed or ran out of memory
        # is not counted as finished), the lines then raising them again
        plans = min(planned.steps, s["steps_done"]) if not abandoned and isinstance(s.get("steps_done"), int) \
            else planned.steps
        release, disagree = _conservative(lines, Event.from_lines(lines, summary), planned, steps, plans,
                                          bool(s["ledger"] or "status" in s))
        out.append(Release(release.event, release.steps, max([*spent, release.epsilon]), abandoned))
        said.update(dict.fromkeys(disagree))
    note = f"{PRIVACY_LEDGER} says {'; '.join(said)}: composed at the config's" if said else None
    if as_written and isinstance(planned, str):
        note = f"{planned}: composed from its {PRIVACY_LEDGER} and summary as written"
    elif as_written and isinstance(planned, Planned):
        other = (f"{_count(as_written, 'attempt')} of another configuration than its config.yaml composed from "
                 f"{PRIVACY_LEDGER} as written")
        note = f"{note}; {other}" if note else other
    return out, note and f"{s['run_dir']}: {note}"


def _attempts(ledger: list[dict], summary: dict) -> list[list[dict]]:
    """A ledger's lines by attempt: a start, and the resumes after it; the summary's line (maybe past the last
    line) is the last attempt's."""
    attempts: list[list[dict]] = []
    for line in ledger:
        if (not attempts or line.get("event") == "start"
                or (line.get("attempt") != attempts[-1][-1].get("attempt") and line.get("event") != "resume")):
            attempts.append([])
        attempts[-1].append(line)
    attempts = attempts or [[]]
    attempts[-1].append(summary)
    return attempts


def _conservative(lines: list[dict], written: Event, planned: Planned, ran: int, plans: int,
                  told: bool) -> tuple[Release, list[str]]:
    """An attempt of its config.yaml's run at the conservative end of what its lines (`written`; `ran`, the steps
    they record) and the config (`plans` steps) say: σ no larger, q no smaller, steps no fewer, and of how it
    sampled and correlated its noise the one of the two that spends more (an edit of either cannot pick the more
    favourable). Returns the Release, and where the lines (where `told`: a folder of no record but the steps its
    files show has none to disagree) or their event are on the side of less ε."""
    sigma_known = any(line.get("sigma") is not None or line.get("sigma_accounted") is not None for line in lines)
    p, steps = planned.event, max(ran, plans)
    taken = replace(p, sigma=min(written.sigma, p.sigma) if sigma_known else p.sigma,
                    sample_rate=max(written.sample_rate or 0.0, p.sample_rate))
    event, again = taken.costlier(taken.sampled_as(written), steps)
    said = [] if event is taken else [f"{written.sampling_text()} where its config.yaml gives {p.sampling_text()} "
                                      "(that of the larger ε taken)"]
    # what its lines say, each at its most favourable: the largest σ, the smallest q, the least ε at its end
    sigmas = [float(line.get("sigma_accounted") or line["sigma"]) for line in lines if line.get("sigma")]
    rates = [float(line["sample_rate"]) for line in lines if line.get("sample_rate")]
    ended = [float(line["epsilon"]) for line in lines
             if line.get("epsilon") is not None and int(line.get("steps_done") or 0) == steps]
    said += [f"{what} {abs(line):.4g} where its config.yaml gives {abs(config):.4g}"
             for what, line, config in (("σ", -max(sigmas, default=p.sigma), -p.sigma),
                                        ("q", min(rates, default=p.sample_rate), p.sample_rate),
                                        ("steps", ran, plans), ("ε", min(ended, default=again), again))
             if told and line < config - 1e-6 * abs(config)]  # the side of less ε
    return Release(event, steps, again), said


def _planned(folder: dict) -> Planned | str | None:
    """What a private run's config.yaml implies for its releases (`Planned`): its event, of σ calibrated to its
    privacy.epsilon by its accountant as the run calibrated it (or its privacy.noise_multiplier), the steps it plans
    and its `config_hash`. None for a run that accounts no ε; where config.yaml cannot say, why. The data set's
    size is the smallest the folder records (the largest q, with which σ is calibrated): the data set is not
    loaded, as it may not be on this machine, and a report reads many folders."""
    from dpmem.config import accounted
    from dpmem.engine.trainer import accounting_of, config_hash
    from dpmem.methods import method_class

    path = Path(folder["run_dir"]) / "config.yaml"
    if not path.is_file():
        return f"it has no {path.name}"
    def least(*found) -> int | None:
        sizes = [n for n in found if isinstance(n, int) and not isinstance(n, bool) and n > 0]
        return min(sizes, default=None)
    try:
        cfg = OmegaConf.load(path)
        spec = method_class(cfg.method.name).spec
        if not spec.private or not accounted(cfg.privacy):
            return None
        lines = folder["ledger"]
        if PrivacyUnit.of(cfg.privacy).uls:  # what it samples are users: the ledger's dataset_size
            count = n = least(folder.get("users"), *(line.get("users") for line in lines),
                              *(line.get("dataset_size") for line in lines))
        else:
            n = least(folder.get("n_train"), *(line.get("dataset_size") for line in lines))
            count = least(folder.get("users"), *(line.get("users") for line in lines))
        if n is None or (count is None and PrivacyUnit.of(cfg.privacy).user):
            return f"neither its summary nor its {PRIVACY_LEDGER} records the size of its data set"
        event, steps = accounting_of(cfg, n, count)
        if event.accountant == "rc":
            event = replace(event, rc=(cfg.method.k, _rc_dimension(cfg, folder), str(cfg.method.estimator)))
        fixed = cfg.privacy.get("noise_multiplier")  # σ given, or calibrated to privacy.epsilon as the run did
        event = (replace(event, sigma=float(fixed)) if fixed is not None
                 else event.calibrated(cfg.privacy.epsilon, steps))
        config = config_hash(cfg)
    except Exception as e:  # noqa: BLE001  (a key missing or of another type, an unknown method, a budget unreachable)
        return f"its {path.name} cannot say what it ran ({type(e).__name__})"
    return Planned(event.as_accounted(), steps, config)


def _rc_dimension(cfg, folder: dict):
    """rc's d: privacy.rc_dimension where it is a number; else the model's, which only building the model tells, as
    the summary records it; without a summary inf, whose envelope bounds every d's."""
    if isinstance(cfg.privacy.rc_dimension, int):
        return cfg.privacy.rc_dimension
    d = (folder.get("rc_accountant") or {}).get("d", "inf")
    return math.inf if d in ("inf", math.inf) else int(d)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def search_privacy(folders: list[dict]) -> list[str]:
    """A line per data set with several private releases: choosing and releasing a result among the runs (a
    search, a grid, a table) releases every one of them, so its ε is their mechanisms composed (dp-accounting, at
    the largest δ). Every release counts (`distinct`, `releases`), but a seeded run's (`seeded`). Runs touch the same
    data when they share data.name and data.path, whatever examples each drew: the conservative reading."""
    from dpmem.privacy import composed_epsilon
    groups, units = defaultdict(list), []
    for f in folders:
        units += [note] if (note := _unit_note(f)) else []
        data = f.get("data") or f["config"].get("data.name")
        if data is not None:  # a folder with neither summary nor config is listed with its ledger's ε
            # a user-level ε and a record-level one are of two guarantees: never composed together
            groups[(data, f["config"].get("data.path"), unit_of(f))].append(f)
    seeded_lines, lines, notes = [], [], []  # the seeded runs' lines first, the folders' `releases` notes last
    for (data, path, unit), group in sorted(groups.items(), key=str):
        name = data + (f" ({path})" if path else "") + (", user-level ε" if unit == "user" else "")
        if derivable := [f for f in group if seeded(f)]:
            seeded_lines.append(f"{name}: {_count(len(derivable), 'seeded run')} not composed here: ε ∞ to a holder "
                                "of their config.yaml (listed below)")
            group = [f for f in group if not seeded(f)]
        made = []
        for f in group:
            out, note = releases(f)
            made += [r for r in out if r.steps]
            if note and any(r.event.accountant and r.steps for r in out):  # one line per folder with a private release
                notes.append(note)
        accounted = [r for r in made if r.composable]
        if len(accounted) < 2:
            continue
        if all(f.get("data_public", f["config"].get("data.public")) for f in group):
            lines.append(f"{name}: {len(group)} runs on data declared public (data.public=true), a proxy: searching "
                         "there spends nothing of a private data set's budget")
            continue
        abandoned, loose = sum(r.abandoned for r in accounted), len(made) - len(accounted)
        runs = _count(len(accounted) - abandoned, "run") + (f" + {_count(abandoned, 'abandoned attempt')}"
                                                           if abandoned else "")
        head = (f"{name}: {len(accounted)} private releases on the same training data ({runs}), each ε ≤ "
                f"{max(r.epsilon for r in accounted):.3g}; ")
        accountants = {(r.event.accountant, r.event.neighbouring) for r in accounted}
        delta = max(r.event.delta for r in accounted)
        try:
            if len(accountants) > 1 or ("rc", "add_remove") in accountants:
                raise ValueError("rc, or several accountants")
            accountant, neighbouring = accountants.pop()
            composed = composed_epsilon([(r.event, r.steps) for r in accounted], delta, accountant, neighbouring)
        except ValueError as e:  # or what an older ledger does not record (the data set's size for fixed sampling)
            lines.append(head + f"their composition is not computed here ({e})")
            continue
        lines.append(head + f"releasing a result chosen among them releases all: ε = {composed:.4g} at δ = "
                     f"{delta:.2g} ({accountant}, composed)" + (f"; {_count(loose, 'more release')} outside any ε "
                                                                 "(no noise, or a leak)" if loose else ""))
    return seeded_lines + lines + units + notes


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


def private_searches(summaries: list[dict], missing: list[dict], holder: bool) -> tuple[list, list, dict]:
    """The runs as the report shows them, and the private searches (hydra/sweeper=private) among them, each folder
    with its ε (`_search_epsilon`): a search's trials replaced by the one row of what it released (its selection/),
    unless `holder` asks for the holder's view (every trial, which tells K: not for release)."""
    from dpmem.engine.selection import KEY_FILE, RELEASED, SELECTION

    def search_of(f: dict) -> Path | None:
        folder = Path(f["run_dir"])
        if (folder / SELECTION).is_file():  # the release itself (its config.yaml), in its search or published alone
            return folder.parent if folder.name == RELEASED else folder
        if (folder.parent / KEY_FILE).exists() or (folder.parent / RELEASED / SELECTION).exists():
            return folder.parent
        return None

    found = {f["run_dir"]: search_of(f) for f in summaries + missing}
    searches = {folder: _search_epsilon(folder) for folder in sorted(set(filter(None, found.values())))}
    if holder:  # the trials, but not the release's folder (the winner's row is among them)
        return ([f for f in summaries if not (Path(f["run_dir"]) / SELECTION).is_file()],
                [f for f in missing if not (Path(f["run_dir"]) / SELECTION).is_file()], searches)
    rows = [r for folder, (epsilon, _) in searches.items() if (r := _released_row(folder, epsilon)) is not None]
    return ([f for f in summaries if found[f["run_dir"]] is None] + rows,
            [f for f in missing if found[f["run_dir"]] is None], searches)


def _released_row(search: Path, epsilon: float) -> dict | None:
    """A private search's row: its released winner (selection/: selection.json and config.yaml) at the search's ε,
    per user where both say so (`unit_of`)."""
    from dpmem.engine.selection import SELECTION, release_of

    try:
        record = json.loads((release_of(search) / SELECTION).read_text())
        tree = OmegaConf.to_container(OmegaConf.load(release_of(search) / "config.yaml"))
    except Exception:  # noqa: BLE001  (missing, unreadable: `selections` says so)
        return None
    config = _flat(tree)
    result = record.get("result") or {}
    return {"status": OK if record.get("ended") == "completed" else f"no release ({record.get('ended')})",
            "method": config.get("method.name"), "data": config.get("data.name"), "model": config.get("model.name"),
            "private": True, "epsilon_target": epsilon, "delta": record.get("delta"),
            "metric_name": result.get("metric_name"), "metric_final": result.get("metric_final"),
            "train_loss": result.get("train_loss"), "run_dir": str(release_of(search)), "config": config,
            "unit": record.get("unit"), "ledger": [], "analysis": None}


def _search_epsilon(search: Path) -> tuple[float, str | None]:
    """`released_epsilon` of the search's selection.json (0 where it cannot be read: nothing is released), with what
    the release's and each trial's config.yaml imply (`_planned`) among what it recomputes from."""
    from dpmem.engine.selection import SELECTION, TRIAL, read_json, release_of, released_epsilon

    record = read_json(release_of(search) / SELECTION)
    if record is None:
        return 0.0, None
    # the release's config.yaml at the data set's size selection.json records (users, where ULS samples them)
    sizes = {"n_train": record.get("dataset_size"), "users": record.get("dataset_size"), "ledger": []}
    planned = [_planned({"run_dir": str(release_of(search)), **sizes})]
    for trial in search.glob(TRIAL + "*"):
        summary = read_json(trial / "summary.json") or {}
        planned.append(_planned({"run_dir": str(trial), "n_train": summary.get("n_train"),
                                 "users": summary.get("users"), "ledger": privacy_records(trial)}))
    return released_epsilon(search, record, [(plan.event, plan.steps) for plan in planned
                                             if isinstance(plan, Planned)])


def _release_unit(release: Path) -> str | None:
    """privacy.unit of a release's config.yaml (None where it has none): a user-level ε where it and selection.json
    both say so, as `unit_of` takes a run's."""
    try:
        return OmegaConf.select(OmegaConf.load(release / "config.yaml"), "privacy.unit")
    except Exception:  # noqa: BLE001  (missing, not YAML)
        return None


def selections(searches: dict, holder: bool) -> list[str]:
    """A line per private search (dpmem.engine.selection): what its selection/ releases and at what ε (recomputed
    from its trials where the holder has them: never below selection.json's)."""
    from dpmem.engine.selection import HOLDER, RELEASED, SELECTION, release_of

    lines = []
    for folder, (epsilon, note) in searches.items():
        try:
            s = json.loads((release_of(folder) / SELECTION).read_text())
            release = f"release {release_of(folder)}/ alone" if s["ended"] == "completed" else "nothing released"
            per = " per user" if s.get("unit") == "user" and _release_unit(release_of(folder)) == "user" else ""
            lines.append(f"{folder}: {s['ended']}; {release}, at ε = {epsilon:.4g}{per} and δ = {s['delta']:.2g} for "
                         f"the whole search ({s['accountant']}; the number of trials secret, {s['law']} of mean "
                         f"{s['mean_trials']:g}); its ε adds to any other release on the same data")
            lines += [note] if note else []
            if holder:
                lines.append(f"{folder}: holder's view, not for release: its trials are in the table and composed "
                             f"above (each trial's folder and score: {folder / HOLDER})")
        except (OSError, ValueError, KeyError, TypeError) as e:
            lines.append(f"{folder}: unreadable {RELEASED}/{SELECTION} ({type(e).__name__}): nothing of it is "
                         "released; publishing its trials costs every one composed (dpmem report --holder)")
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
    failed = [f"{s['run_dir']}: {s['status']}" + (f" ({s['error']})" if s.get("error") else "")
              + f", {s.get('steps_done')}/{s.get('steps')} steps" + _released_more(s)
              for s in summaries if s["status"] not in (OK, "oom")]
    return failed + [f"{m['run_dir']}: {m['why']}" for m in missing]


def _released_more(s: dict) -> str:
    """For a resumed run stopped before it redid the steps an earlier attempt released: how many that was."""
    released, done = s.get("steps_released"), s.get("steps_done")
    return f" ({released} released by an earlier attempt)" if isinstance(released, int) and isinstance(
        done, int) and released > done else ""


PUBLISHED = Path(__file__).with_name("published.csv")
ALIASES = {"adam": "adamw"}  # dpmem's name -> the papers' where they differ (AdamW is the papers' non-private row)


@functools.cache
def published() -> dict[tuple[str, str, str, str], dict]:
    """(method, ε, data, model) -> {value, se, source} from the papers' tables (published.csv: values in %, or OOM)."""
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
        keys = table_cells[(row, eps, data)]["paper"]  # (method, model) of each run: one, or no match
        hit = next((paper.get((method, eps, data, model)) for method, model in keys), None) if len(keys) == 1 else None
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


def _listed(title: str, lines: list[str]) -> list[str]:
    """A titled list under the table, or nothing without lines."""
    return ["", title, "", *(f"- {line}" for line in lines)] if lines else []


def write(out: Path, summaries: list[dict], missing: list[dict], compare: bool = False,
          select: str | None = None, holder: bool = False) -> str:
    """report.md, report.csv and report.tex in `out` from `collect`'s summaries and folders without one (with
    `compare`, the papers' numbers in brackets; with `select="top3"`, one run per method, ε and data set:
    `top_three`); returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    summaries, missing, searches = private_searches(summaries, missing, holder)
    analysed = [f for f in summaries + missing if f["analysis"]]
    summaries = [s for s in summaries if not s["analysis"]]
    missing = [m for m in missing if not m["analysis"]]
    # every release counts, whatever verb wrote into its folder last: an analysis written over a training run
    # (train.overwrite=true) leaves that run's ledger (dpmem audit's own run, AUDIT/run, is none it wrote over)
    overwritten = [f for f in analysed if f["ledger"]
                   and not (Path(f["run_dir"]).name == "run" and _analysis(Path(f["run_dir"])) == "audit")]
    searched = search_privacy(summaries + missing + overwritten)
    summaries, repeats = distinct(summaries)
    summaries, chosen = top_three(summaries) if select == "top3" else (summaries, [])
    table_cells = cells(summaries)
    columns, rows, texts, best = table(table_cells)
    texts, sources = with_published(table_cells, texts) if compare else (texts, [])
    metrics = sorted({str(c["metric"]) for c in table_cells.values()})
    md = [f"**The holder's view, not for release**: it lists every trial of {', '.join(map(str, searches))}, which "
          "tells how many it ran (K, secret); publish a search's selection/ folder alone.", ""] \
        if holder and searches else []
    md += [f"Final {', '.join(metrics)} ({'losses as they are, others ' if any(map(is_loss, metrics)) else ''}%), "
          "mean ± standard error over seeds; **bold**: best private result per column; OOM: out of memory.", "",
          "| method | ε | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    tex = [r"\begin{tabular}{ll" + "c" * len(columns) + "}", r"\toprule",
           "method & $\\varepsilon$ & " + " & ".join(columns) + r" \\", r"\midrule"]
    for m, e in rows:
        marked = [(texts.get((m, e, d), ""), (m, e, d) in best) for d in columns]
        md.append(f"| {m} | {e} | " + " | ".join(f"**{t}**" if b else t for t, b in marked) + " |")
        tex_marked = [(t.replace("±", r"$\pm$").replace("–", "--"), b) for t, b in marked]
        tex.append(f"{m} & {e} & " + " & ".join(rf"\textbf{{{t}}}" if b else t for t, b in tex_marked) + r" \\")
    tex += [r"\bottomrule", r"\end{tabular}"]
    md += memory_table(summaries)
    if compare:
        md += ["", "[In brackets]: the published number for the same method, ε and data set, from: "
               + ("; ".join(sources) if sources else "no matching table") + "."]
    derivable, left = seeded_runs(summaries), unfinished(summaries, missing) + repeats
    md += (_listed("Each cell is one run: the best final metric of the three with the lowest final training loss "
                   "(--select top3):", chosen)
           + _listed("The privacy of releasing a result chosen among these runs (docs/privacy.md, Searching on "
                     "private data):", searched)
           + _listed(f"Seeded runs ({len(derivable)}; in the table at ε {SEEDED}, never best private, composed into "
                     "no ε):", derivable)
           + _listed("Private selections (docs/privacy.md, Private selection):", selections(searches, holder))
           + _listed("Correlated noise (docs/privacy.md, Correlated noise): how each run's ε was computed:",
                     [f"{s['run_dir']}: {s['noise']} ({s.get('bands')} bands, {s.get('groups')} cyclic groups): "
                      f"{s.get('privacy_analysis')}" for s in summaries if s.get("noise") not in (None, "independent")])
           + _listed(f"Not in the table ({len(left)}):", left)
           + _listed(f"Folders of an analysis, not results ({len(analysed)}; neither in the table nor composed with "
                     "the runs above):", analyses(analysed)))
    with open(out / "report.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "epsilon", "data", "metric", "n", "mean", "se", "oom", "best_private",
                    "derivable_from_config", "cell"])
        for key in sorted(table_cells, key=lambda k: (k[0], _epsilon_order(k[1]), k[2])):
            c = table_cells[key]
            w.writerow([*key, c["metric"], c["n"], c["mean"], c["se"], c["oom"], key in best, key[1] == SEEDED,
                        texts[key]])
    if drawn := figures.write(out, summaries, table_cells):
        md += ["", "Figures: " + ", ".join(f for f in drawn if f.endswith(".png")) + " (and PDF)."]
    text = "\n".join(md) + "\n"
    (out / "report.md").write_text(text)
    (out / "report.tex").write_text("\n".join(tex) + "\n")
    return text
