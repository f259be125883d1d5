"""A private search (`dpmem train -m hydra/sweeper=private`; Papernot & Steinke, ICLR 2022): a random search whose
number of trials K is drawn, secretly, from a law of mean `mean_trials` and shape `shape` (dpmem.privacy.selection),
and whose best trial alone is released, the whole search within `privacy.epsilon`. What it keeps fixed, how it
scores, where its key lives and what it writes: docs/privacy.md, Private selection."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from hydra.core.override_parser.overrides_parser import OverridesParser

from dpmem.config import ConfigError, enum_value
from dpmem.engine.checkpoint import MODEL  # a trial's final weights: the winner's released, the others' removed
# a search's folder's names (no verb writes into one: folder.search_part): its key, its release, the holder's record
from dpmem.engine.folder import HOLDER, KEY_FILE, RELEASED, SELECTION, TRIAL
from dpmem.privacy.accounting import Event
from dpmem.privacy.randomness import derive, os_key
from dpmem.privacy.record import PrivacyUnit

RELEASE = "release.json"  # in each trial's folder: not for release, and why
TRIALS_LOG = "trials.log"  # what the trials printed (the holder's, as search.json is: they tell K)
# what the accountant sees of a trial, and so the same in every trial: these keys, and the privacy and data groups
# with every key below them (the method's options, as its clipping norm or rank, change no accounting)
ACCOUNTED = ("method", "method.name", "train.batch_size", "train.steps", "train.epochs", "train.sampling")
ACCOUNTED_GROUPS = ("privacy", "data")
# why no trial logs to a tracker: its run (its folder's name, config, metrics, summary) is a release of the trial
TRACKER_REFUSED = "each trial's wandb run would publish that trial (so every trial, and K)"


@dataclass(frozen=True)
class Dimension:
    """One hyperparameter of the space: a choice among values, or an interval (uniform, log-uniform, integer)."""
    key: str
    values: tuple = ()
    start: float = 0.0
    end: float = 0.0
    log: bool = False
    integer: bool = False

    def draw(self, rng: np.random.Generator) -> str:
        if self.values:
            return f"{self.key}={self.values[rng.integers(len(self.values))]}"
        if self.integer:
            return f"{self.key}={int(rng.integers(int(self.start), int(self.end) + 1))}"
        lo, hi = (math.log(self.start), math.log(self.end)) if self.log else (self.start, self.end)
        value = lo + rng.random() * (hi - lo)
        return f"{self.key}={math.exp(value) if self.log else value!r}"


def parse_space(arguments: list[str], params: dict | None) -> tuple[list[str], list[Dimension]]:
    """The fixed overrides every trial takes, and the dimensions drawn for each (from the command line's sweeps and
    `hydra.sweeper.params`). Raises ConfigError naming the key."""
    given = [a for a in arguments if not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    given += [f"{k}={v}" for k, v in (params or {}).items()]
    fixed, dims = [], []
    for o in OverridesParser.create().parse_overrides(given):
        key = o.input_line.split("=", 1)[0]
        if not o.is_sweep_override():
            fixed.append(o.input_line)
            continue
        name = key.lstrip("+~")
        if name in ACCOUNTED or any(name == g or name.startswith((g + ".", g + "/")) for g in ACCOUNTED_GROUPS):
            raise ConfigError(key, "a private search keeps what its accountant sees (batch size, steps, sampling, "
                              "data, privacy.*, the method) the same in every trial: give it one value")
        if name == "logging" or name.startswith("logging.wandb"):
            raise ConfigError(key, f"a private search's trials log to no tracker: {TRACKER_REFUSED}; give it one "
                              "value, with logging.wandb.enabled=false")
        v = o.value()
        if o.is_interval_sweep():
            integer = isinstance(v.start, int) and isinstance(v.end, int)
            if v.start > v.end or ("log" in v.tags and v.start <= 0):
                raise ConfigError(key, f"{o.input_line.split('=', 1)[1]}: an interval needs lower <= upper, and a "
                                  "log one a lower bound > 0")
            dims.append(Dimension(key, start=v.start, end=v.end, log="log" in v.tags, integer=integer))
        elif o.is_range_sweep():
            dims.append(Dimension(key, values=tuple(np.arange(v.start, v.stop, v.step).tolist())))
        else:
            dims.append(Dimension(key, values=tuple(v.list)))
    if not dims:
        raise ConfigError("hydra.sweeper.params", "a private search needs a space to draw from: give at least one "
                          "key a choice (a,b), range() or interval(), e.g. 'train.lr=tag(log, interval(1e-5, 1e-3))'")
    return fixed, dims


@dataclass
class Search:
    """A private search's law, budget and trials' noise, checked and calibrated from the base configuration."""
    mean: float
    shape: float
    epsilon: float
    delta: float
    sigma: float  # each trial's gradient noise multiplier (at least), for the whole search's budget
    trial_epsilon: float  # what each trial, accounted alone, spends: trials run at privacy.epsilon=this
    objective: str
    neighbouring: str
    accountant: str  # each trial's own (its ledger's)
    unit: str = "record"  # what ε protects: a record, or all of a user's records (privacy.unit=user, ULS)
    # each trial's event, which selection.json carries so that its ε can be recomputed without the trials: the joint
    # multiplier (the gradient's and the loss's releases as one Gaussian), the rate, the steps
    sigma_accounted: float | None = None
    sample_rate: float | None = None
    steps: int | None = None
    sampling: str = "poisson"
    dataset_size: int | None = None

    @property
    def minimise(self) -> bool:
        return self.objective == "train_loss"


def plan_search(cfg, mean, shape, arguments: list[str]) -> Search:
    """Check a private search of the base config `cfg` (with `arguments`, the command line's overrides) and
    calibrate its trials' noise. Raises ConfigError naming the key."""
    from dpmem.engine.trainer import accounting_of
    from dpmem.methods import method_class
    from dpmem.privacy import UnreachableTarget
    from dpmem.privacy.selection import ELS_REFUSED, calibrate_selection, check_law

    try:
        mean, shape = float(mean), float(shape)
        check_law(mean, shape)
    except (TypeError, ValueError) as e:
        key = "hydra.sweeper.mean_trials" if "mean" in str(e) or not isinstance(mean, float) else "hydra.sweeper.shape"
        raise ConfigError(key, str(e).split(": ", 1)[-1]) from None
    p, t, name = cfg.privacy, cfg.train, cfg.method.name
    if not method_class(name).spec.private:
        raise ConfigError("method", f"{name} is not private: hydra/sweeper=private selects among private runs (for a "
                          "non-private search: hydra/sweeper=search)")
    if p.get("noise_multiplier") is not None:
        raise ConfigError("privacy.noise_multiplier", f"{p.noise_multiplier:g}: a private search calibrates its "
                          "trials' noise to the whole search's budget; give that budget (privacy.epsilon=4), not σ")
    if p.epsilon is None:
        raise ConfigError("privacy.epsilon", "a private search needs the budget of the whole search, e.g. "
                          "privacy.epsilon=4")
    if cfg.logging.wandb.enabled:
        raise ConfigError("logging.wandb.enabled", "true: a private search releases its selection/ folder alone, and "
                          f"{TRACKER_REFUSED}; leave wandb off (logging.wandb.enabled=false) and share selection/")
    for seed in ("noise_seed", "sampler_seed"):  # a trial a config.yaml replays has ε ∞ against its holder
        if p.get(seed) is not None:
            raise ConfigError(f"privacy.{seed}", f"{p[seed]}: a private search's trials draw their noise and batches "
                              "from the OS; a seed in config.yaml replays them (ε ∞ to its holder): leave it out")
    event, steps = accounting_of(cfg)
    if event.noise is not None:
        raise ConfigError("privacy.noise", f"{event.noise[0]}: a private search composes its trials as "
                          "Poisson-subsampled DP-SGD (RepeatAndSelectDpEvent); correlated noise's trials are not "
                          "accounted there yet: allowed: independent")
    if event.accountant == "rc":
        raise ConfigError("privacy.accountant", f"{name}'s rc accountant has no RDP curve, which a private selection "
                          "composes (dp-accounting's RepeatAndSelectDpEvent): use a method accounted by pld or rdp")
    if event.user_records is not None:
        raise ConfigError("privacy.user_sampling", f"records: {ELS_REFUSED}")
    explicit = any(a.split("=", 1)[0] == "train.objective" for a in arguments)
    objective = enum_value(t.objective) if explicit else "train_loss"
    if objective == "metric" and not cfg.data.get("public", False):
        raise ConfigError("train.objective", "a metric on the private data's held-out split is not a private score: "
                          "use train.objective=train_loss (the privately released loss, the default of a private "
                          "search), or a metric on data declared public (data.public=true)")
    if objective == "train_loss" and enum_value(p.train_loss) != "private":
        raise ConfigError("privacy.train_loss", f"{enum_value(p.train_loss)}: a private search scores trials by the "
                          "privately released loss: privacy.train_loss=private")
    try:
        sigma = calibrate_selection(p.epsilon, event.delta, event.sample_rate, steps, mean, shape,
                                    event.neighbouring, event.sampling, event.dataset_size, event.loss_noise,
                                    user_records=event.user_records)
    except UnreachableTarget as e:
        raise ConfigError("privacy.epsilon", str(e)) from None
    except ValueError as e:
        raise ConfigError("privacy.neighbouring", str(e)) from None
    # each trial calibrates its own σ to this ε (its ledger's accountant): a hair more noise than `sigma`, never less
    trial = replace(event, sigma=sigma * (1 + 1e-3)).epsilon(steps)
    return Search(mean, shape, float(p.epsilon), event.delta, sigma, trial, objective, event.neighbouring,
                  event.accountant, PrivacyUnit.of(p).name, replace(event, sigma=sigma).joint_sigma,
                  event.sample_rate, steps, event.sampling, event.dataset_size)


def describe(search: Search, fixed: list[str], dims: list[Dimension]) -> dict:
    """What a search's key belongs to: a resume must ask for the same law and space."""
    return {"mean_trials": search.mean, "shape": search.shape, "space": sorted(fixed) + [str(d) for d in dims]}


def resumable(folder: Path, what: dict) -> bytes:
    """The key of the search in `folder`, if it is `what`'s. Raises ConfigError."""
    try:
        saved = json.loads((folder / KEY_FILE).read_text())
        key, search = bytes.fromhex(saved["key"]), saved["search"]
        if len(key) < 16:
            raise ValueError("a key of fewer than 128 bits")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("hydra.sweep.dir", f"{folder / KEY_FILE} cannot be read ({type(e).__name__}): without it "
                          "the search cannot resume with its K; choose another folder") from None
    if search != what:
        raise ConfigError("hydra.sweep.dir", f"{folder} holds another private search ({search}): resume it with the "
                          "same law and space, or choose another folder")
    return key


def check_folder(folder: Path, what: dict) -> bytes | None:
    """The key of the search `folder` holds, if it is `what`'s; None for a folder that is missing or empty (a new
    search). Raises ConfigError for any other folder: one that holds files of its own, or a search whose key is gone
    (a new key would draw a new K: a second search on the same data, after the first one's trials spent theirs)."""
    from dpmem.engine.folder import LOCK, search_part

    try:
        names = {e.name for e in folder.iterdir()} - {LOCK}
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError("hydra.sweep.dir", f"{folder} cannot be read as a folder ({e.strerror})") from None
    if not names:
        return None
    if KEY_FILE in names:
        if names == {KEY_FILE} and (folder / KEY_FILE).stat().st_size == 0:
            return None  # a key cut short (a full disk) before any trial ran: nothing was spent, a new one is drawn
        return resumable(folder, what)
    if names & {HOLDER, RELEASED, TRIALS_LOG} or any(n.startswith(TRIAL) for n in names):
        held = (f"a private search whose {KEY_FILE} is gone: its K cannot be drawn again, and a new key would start a "
                "second search on the same data (the first one's trials spent their ε)")
    elif SELECTION in names:
        held = search_part(folder)  # (a search's release, published or not)
    else:
        held = f"files of its own ({', '.join(sorted(names)[:4])}{', ...' if len(names) > 4 else ''})"
    raise ConfigError("hydra.sweep.dir", f"{folder} holds {held}: a private search writes into an empty folder, or "
                      f"resumes its own from its {KEY_FILE}; give another hydra.sweep.dir")


class SearchState:
    """The search's secret key in the sweep folder (made once, read again on a resume); K, each trial's draw of
    the space, its folder's name and the winner among tied scores derive from it."""

    def __init__(self, folder: Path, search: Search, fixed: list[str], dims: list[Dimension]):
        from dpmem.engine.summary import DiskFull, replace_file
        from dpmem.privacy.selection import draw_trials

        what = describe(search, fixed, dims)
        key = check_folder(folder, what)
        if key is None:
            key = os_key()
            folder.mkdir(parents=True, exist_ok=True)
            old = os.umask(0o077)  # as private as the data; written whole or not at all (a full disk leaves none)
            try:
                replace_file(folder / KEY_FILE, json.dumps({"key": key.hex(), "search": what}).encode())
            except DiskFull as e:
                raise ConfigError("hydra.sweep.dir", f"{e}: the search's key could not be written, nothing was "
                                  "run") from None
            finally:
                os.umask(old)
        self.key = key
        self.trials = draw_trials(search.mean, search.shape, derive(self.key, "trials"))

    def _rng(self, purpose: str, index: int = 0) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64DXSM(int.from_bytes(derive(self.key, purpose, index), "little")))

    def point(self, trial: int, dims: list[Dimension]) -> list[str]:
        rng = self._rng("trial", trial)
        return [d.draw(rng) for d in dims]

    def name(self, trial: int) -> str:
        """A trial's folder: drawn from the key, so that neither a name nor the names' order tells its position."""
        return TRIAL + derive(self.key, "folder", trial).hex()[:16]

    def tie(self, tied: list[int]) -> int:
        """The winner among trials of equal score, uniformly (the position of none counts)."""
        return tied[int(self._rng("ties").integers(len(tied)))]


def trial_overrides(search: Search, fixed: list[str], point: list[str], name: str) -> list[str]:
    """A trial's overrides: the fixed ones, its draw of the space, its own ε (the search's budget replaced), the
    score, train.skip_done (a resumed search skips the trials that finished), its final weights kept (the winner's
    are released) and its folder's name."""
    mine = ("privacy.epsilon", "train.objective", "train.skip_done", "train.save_model")
    return [*(o for o in fixed if o.split("=", 1)[0] not in mine), *point,
            f"privacy.epsilon={search.trial_epsilon!r}", f"train.objective={search.objective}", "train.skip_done=true",
            "train.save_model=true", f"hydra.sweep.subdir={name}"]


def read_json(path: Path) -> dict | None:
    """A JSON object's file, or None where it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def finish(folder: Path, search: Search, state: SearchState, results: list[tuple[Path, float | None]],
           points: list[list[str]]) -> dict:
    """What the search releases, in `selection/` alone: selection.json (the ε, the law, the winner's hyperparameters
    and private score), the winner's config.yaml and model.pt; nothing that tells K or the winner's position among
    the trials. The holder's record (search.json: every trial's folder and score) and each trial's release.json stay
    in the sweep folder, not for release. `results`: each trial's folder and score (None: failed), in trial order."""
    from dpmem.engine.summary import replace_file
    from dpmem.privacy import composed_epsilon
    from dpmem.privacy.selection import law

    done = [i for i, (_, s) in enumerate(results) if s is not None and math.isfinite(s)]  # (None: failed; NaN, inf)
    best = None
    if done:
        top = (min if search.minimise else max)(results[i][1] for i in done)
        best = state.tie([i for i in done if results[i][1] == top])
    summaries = [read_json(run_dir / "summary.json") for run_dir, _ in results]
    low = [r.name for (r, _), s in zip(results, summaries) if s and (s.get("sigma") or 0) < search.sigma]
    if low:  # a trial ran with less noise than the selection's ε needs: nothing here may be released under it
        best = None
    ended = ("completed" if best is not None else "no trial drawn (Poisson law)" if not results
             else "no release: a trial ran with less noise than the selection needs" if low
             else "no release: every trial failed")
    winner = (summaries[best] or {}) if best is not None else {}
    per = ("user: all of one user's records added or removed together (privacy.unit=user)" if search.unit == "user"
           else "record")
    record = {"epsilon": search.epsilon if best is not None else 0.0, "delta": search.delta, "unit": search.unit,
              "guarantee": f"(ε, δ) of the whole search, per {per}",
              "mean_trials": search.mean, "shape": search.shape, "law": law(search.shape),
              "accountant": "rdp (dp-accounting RepeatAndSelectDpEvent)", "neighbouring": search.neighbouring,
              "trial_sigma": search.sigma, "trial_epsilon": search.trial_epsilon,
              # what the ε is recomputed from where the trials are gone (`released_epsilon`)
              "trial_sigma_accounted": search.sigma_accounted, "trial_sample_rate": search.sample_rate,
              "trial_steps": search.steps, "sampling": search.sampling, "dataset_size": search.dataset_size,
              "score": f"{search.objective} ({'lowest' if search.minimise else 'highest'} wins)", "ended": ended}
    if best is not None:
        record.update(hyperparameters=dict(p.split("=", 1) for p in points[best]),
                      result={k: winner.get(k) for k in ("train_loss", "metric_name", "metric_final")},
                      files=sorted([SELECTION, "config.yaml"] + ([MODEL] if (results[best][0] / MODEL).exists()
                                                                 else [])))
    # the release, made whole beside the old one and then put in its place: one folder, nothing else in it, each
    # file a new one (never a link to the winner's: its inode and birth time would tell how many trials ran after it)
    made = folder / (RELEASED + ".tmp")
    shutil.rmtree(made, ignore_errors=True)
    try:
        made.mkdir()
        for name in record.get("files", [SELECTION]):
            if name == SELECTION:
                replace_file(made / name, (json.dumps(record, indent=2) + "\n").encode())
            else:
                _copied(results[best][0] / name, made / name)
        shutil.rmtree(folder / RELEASED, ignore_errors=True)
        os.replace(made, folder / RELEASED)
    except OSError as e:
        shutil.rmtree(made, ignore_errors=True)
        raise _not_written(e, folder / RELEASED, f"the search's trials ran, but its release ({RELEASED}/) was not "
                           "written") from None
    for i, (run_dir, _) in enumerate(results):  # the other trials' weights: K models on disk no longer
        if i != best:
            (run_dir / MODEL).unlink(missing_ok=True)

    runs = [(Event(s.get("sigma_accounted") or s.get("sigma") or 0.0, search.delta, s["sample_rate"],
                   sampling=s.get("sampling", "poisson"), dataset_size=s.get("n_train")), s.get("steps_done") or 0)
            for s in summaries if s and s.get("sample_rate")]
    try:
        together = composed_epsilon(runs, search.delta, search.accountant, search.neighbouring) if runs else 0.0
    except ValueError:
        together = math.inf
    not_for_release = (f"the holder's record of a private search: it tells K and each trial's position; publish "
                       f"{RELEASED}/ alone")
    holder = {"not_for_release": not_for_release, "released": f"{RELEASED}/", "ended": ended,
              "winner": results[best][0].name if best is not None else None, "low_noise": low,
              "epsilon_if_every_trial_released": together,
              "trials": [{"folder": r.name, "score": s, "status": (m or {}).get("status")}
                         for (r, s), m in zip(results, summaries)]}
    try:
        _holders_records(folder, search, results, best, holder, together)
    except OSError as e:
        raise _not_written(e, e.filename, f"the search's release ({RELEASED}/) is written, but not the holder's "
                           f"{HOLDER} and its trials' {RELEASE}") from None
    return record


def _holders_records(folder: Path, search: Search, results: list[tuple[Path, float | None]], best: int | None,
                     holder: dict, together: float) -> None:
    """search.json, and each trial's release.json (not for release)."""
    from dpmem.engine.summary import replace_file

    replace_file(folder / HOLDER, (json.dumps(holder, indent=2) + "\n").encode())
    for i, (run_dir, _) in enumerate(results):
        if run_dir.is_dir():
            release = {"for_release": False, "selection": f"../{RELEASED}/{SELECTION}", "delta": search.delta,
                       "why": (f"the winner, released as ../{RELEASED}/ (its config and weights): this folder's "
                               "ledger times and .hydra/ tell its position among the trials" if i == best else
                               "a trial of a private search: only its winner is released, under the search's ε"),
                       "epsilon_if_released_too": together,
                       "accountant": f"{search.accountant}, every trial of the search composed (as dpmem report "
                                     "--holder)"}
            replace_file(run_dir / RELEASE, (json.dumps(release, indent=2) + "\n").encode())


def _copied(source: Path, target: Path) -> None:
    """`target` a new file of `source`'s bytes, written under a temporary name and then renamed: its own inode,
    link count and birth time, none of them the source's."""
    tmp = target.with_name(target.name + ".tmp")
    with open(source, "rb") as read, open(tmp, "wb") as write:
        shutil.copyfileobj(read, write, 1 << 20)
    os.replace(tmp, target)


def _not_written(e: OSError, where: Path | str | None, what: str) -> ConfigError:
    """A write of `finish` into `where` that failed (a full disk), as one line: what was not written, and that the
    same command finishes the search (its key, K and finished trials are kept)."""
    full = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded"}.get(e.errno)
    where = f"{where}: " if where else ""
    return ConfigError("hydra.sweep.dir", f"{where}{full or e.strerror or type(e).__name__}: {what}; "
                       f"{'free some space' if full else 'mend that'} and run the same command again: it finishes the "
                       "search (the same K; finished trials are skipped)")


def release_of(folder: Path) -> Path:
    """The released folder of the search in `folder`, or `folder` itself where it is a release (selection.json in
    it: a search's selection/ published alone, maybe under another name)."""
    return folder if (folder / SELECTION).is_file() else folder / RELEASED


def released_epsilon(folder: Path, record: dict, planned: list[tuple[Event, int]] = ()) -> tuple[float, str | None]:
    """The ε of the search in `folder` that `record` (its selection/selection.json) releases, recomputed from what
    it and its trials say was run: the least σ, the largest rate and steps of selection.json's trial event, the
    trials' summaries and `planned` (what the release's and each trial's config.yaml imply: an event and its steps),
    under the law of the largest ε that selection.json, the key's record or a trial's .hydra/hydra.yaml names. Never
    selection.json's ε field alone: at least the recomputed ε, with a line where the two disagree; ∞ where nothing
    recomputes it, or where the trials ran under ELS (`ELS_REFUSED`), which has no user-level bound here."""
    from omegaconf import OmegaConf

    from dpmem.privacy.selection import ELS_REFUSED, selection_epsilon

    if record.get("ended") != "completed":
        return 0.0, None
    shown = release_of(folder) / SELECTION
    try:
        recorded = float(record.get("epsilon") or 0.0)
    except (TypeError, ValueError):
        recorded = 0.0
    folders = sorted(folder.glob(TRIAL + "*"))
    trials = [s for t in folders if (s := read_json(t / "summary.json")) and s.get("sample_rate")
              and s.get("steps_done")]
    if any(s.get("derivable_from_config") for s in trials):  # (an older dpmem's search: seeds are refused now)
        return math.inf, f"{folder}: its trials' noise or batches derive from seeds in their config.yaml: ε ∞"
    if any(PrivacyUnit.in_summary(s).els for s in trials) or any(
            event.user_records is not None for event, _ in planned):  # (an older dpmem's search: refused now)
        return math.inf, f"{folder}: ε ∞ per user, since {ELS_REFUSED}"
    keyed = (read_json(folder / KEY_FILE) or {}).get("search") or {}
    laws = [(w.get("mean_trials"), w.get("shape")) for w in (record, keyed)]
    for t in folders:
        with contextlib.suppress(Exception):  # (missing, not YAML: the other records say)
            sweeper = OmegaConf.load(t / ".hydra" / "hydra.yaml").hydra.sweeper
            laws.append((sweeper.mean_trials, sweeper.shape))
    own = {"sigma": record.get("trial_sigma_accounted"), "sample_rate": record.get("trial_sample_rate"),
           "steps": record.get("trial_steps")}  # selection.json's own trial event (the trials may be gone)
    runs = [{"sigma": float(s.get("sigma_accounted") or s["sigma"]), "sample_rate": float(s["sample_rate"]),
             "steps": int(s["steps_done"])} for s in trials] + ([own] if all(own.values()) else []) + [
        {"sigma": event.sigma, "sample_rate": event.sample_rate, "steps": steps} for event, steps in planned]
    first = trials[0] if trials else {"n_train": record.get("dataset_size"), **record}
    try:
        laws = {(float(m), float(k)) for m, k in laws if m is not None and k is not None}
        sigma, rate = min(float(r["sigma"]) for r in runs), max(float(r["sample_rate"]) for r in runs)
        steps = max(int(r["steps"]) for r in runs)
        again = max(selection_epsilon(sigma, float(record["delta"]), rate, steps, mean, shape,
                                      first.get("neighbouring") or "add_remove", first.get("sampling") or "poisson",
                                      first.get("n_train")) for mean, shape in laws)
    except (KeyError, TypeError, ValueError) as e:  # (no runs or no law: max() of nothing)
        return math.inf, (f"{shown}: its ε cannot be recomputed ({type(e).__name__}: neither it nor the search's "
                          "folder says the trials' law, noise, rate and steps), and is not taken from its ε field "
                          "alone: shown at ∞")
    if again > recorded * (1 + 1e-3):
        return again, (f"{shown} says ε {recorded:.4g} where its trials' noise, rate and steps give {again:.4g}: "
                       f"shown at {again:.4g}")
    return max(recorded, again), None
