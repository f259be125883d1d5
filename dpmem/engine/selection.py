"""A private search (`dpmem train -m hydra/sweeper=private`; Papernot & Steinke, ICLR 2022): a random search whose
number of trials K is drawn, secretly, from a law of mean `mean_trials` and shape `shape` (dpmem.privacy.selection),
and whose best trial alone is released, the whole search within `privacy.epsilon`. What it keeps fixed, how it
scores, where its key lives and what it writes: docs/privacy.md, Private selection."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hydra.core.override_parser.overrides_parser import OverridesParser

from dpmem.config import ConfigError, enum_value
from dpmem.privacy.randomness import derive, os_key

KEY_FILE, SELECTION, RELEASE = "selection.key", "selection.json", "release.json"
# what the accountant sees of a trial, and so the same in every trial: these keys, and the privacy and data groups
# with every key below them (the method's options, as its clipping norm or rank, change no accounting)
ACCOUNTED = ("method", "method.name", "train.batch_size", "train.steps", "train.epochs", "train.sampling")
ACCOUNTED_GROUPS = ("privacy", "data")


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

    @property
    def minimise(self) -> bool:
        return self.objective == "train_loss"


def plan_search(cfg, mean, shape, arguments: list[str]) -> Search:
    """Check a private search of the base config `cfg` (with `arguments`, the command line's overrides) and
    calibrate its trials' noise. Raises ConfigError naming the key."""
    from dpmem.engine.trainer import accounting_of
    from dpmem.methods import method_class
    from dpmem.privacy import UnreachableTarget, epsilon_spent
    from dpmem.privacy.selection import calibrate_selection, check_law

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
    if p.epsilon is None:
        raise ConfigError("privacy.epsilon", "a private search needs the budget of the whole search, e.g. "
                          "privacy.epsilon=4")
    run = accounting_of(cfg)
    if run["accountant"] == "rc":
        raise ConfigError("privacy.accountant", f"{name}'s rc accountant has no RDP curve, which a private selection "
                          "composes (dp-accounting's RepeatAndSelectDpEvent): use a method accounted by pld or rdp")
    explicit = any(a.split("=", 1)[0] == "train.objective" for a in arguments)
    objective = enum_value(t.objective) if explicit else "train_loss"
    if objective == "metric" and not cfg.data.get("public", False):
        raise ConfigError("train.objective", "a metric on the private data's held-out split is not a private score: "
                          "use train.objective=train_loss (the privately released loss, the default of a private "
                          "search), or a metric on data declared public (data.public=true)")
    if objective == "train_loss" and enum_value(p.train_loss) != "private":
        raise ConfigError("privacy.train_loss", f"{enum_value(p.train_loss)}: a private search scores trials by the "
                          "privately released loss: privacy.train_loss=private")
    delta, neighbouring = run["delta"], run["neighbouring"]
    try:
        sigma = calibrate_selection(p.epsilon, delta, run["sample_rate"], run["steps"], mean, shape, neighbouring,
                                    run["sampling"], run["dataset_size"], run["loss_noise"])
    except UnreachableTarget as e:
        raise ConfigError("privacy.epsilon", str(e)) from None
    except ValueError as e:
        raise ConfigError("privacy.neighbouring", str(e)) from None
    # each trial calibrates its own σ to this ε (its ledger's accountant): a hair more noise than `sigma`, never less
    trial = epsilon_spent(sigma * (1 + 1e-3), **run)
    return Search(mean, shape, float(p.epsilon), delta, sigma, trial, objective, neighbouring, run["accountant"])


def describe(search: Search, fixed: list[str], dims: list[Dimension]) -> dict:
    """What a search's key belongs to: a resume must ask for the same law and space."""
    return {"mean_trials": search.mean, "shape": search.shape, "space": sorted(fixed) + [str(d) for d in dims]}


def resumable(folder: Path, what: dict) -> str:
    """The key (hex) of the search in `folder`, if it is `what`'s. Raises ConfigError."""
    try:
        saved = json.loads((folder / KEY_FILE).read_text())
        key, search = saved["key"], saved["search"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("hydra.sweep.dir", f"{folder / KEY_FILE} cannot be read ({type(e).__name__}): without it "
                          "the search cannot resume with its K; choose another folder") from None
    if search != what:
        raise ConfigError("hydra.sweep.dir", f"{folder} holds another private search ({search}): resume it with the "
                          "same law and space, or choose another folder")
    return key


class SearchState:
    """The search's secret key in the sweep folder (made once, read again on a resume); K and each trial's draw of
    the space derive from it."""

    def __init__(self, folder: Path, search: Search, fixed: list[str], dims: list[Dimension]):
        from dpmem.privacy.selection import draw_trials

        what = describe(search, fixed, dims)
        path = folder / KEY_FILE
        if path.exists():
            self.key = bytes.fromhex(resumable(folder, what))
        else:
            self.key = os_key()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # as private as the data
            with os.fdopen(fd, "w") as f:
                json.dump({"key": self.key.hex(), "search": what}, f)
        self.trials = draw_trials(search.mean, search.shape, derive(self.key, "trials"))

    def point(self, trial: int, dims: list[Dimension]) -> list[str]:
        rng = np.random.Generator(np.random.PCG64DXSM(int.from_bytes(derive(self.key, "trial", trial), "little")))
        return [d.draw(rng) for d in dims]


def trial_overrides(search: Search, fixed: list[str], point: list[str]) -> list[str]:
    """A trial's overrides: the fixed ones, its draw of the space, its own ε (the search's budget replaced), the
    score, and train.skip_done (a resumed search skips the trials that finished)."""
    mine = ("privacy.epsilon", "train.objective", "train.skip_done")
    return [*(o for o in fixed if o.split("=", 1)[0] not in mine), *point,
            f"privacy.epsilon={search.trial_epsilon!r}", f"train.objective={search.objective}", "train.skip_done=true"]


def finish(folder: Path, search: Search, results: list[tuple[Path, float | None]]) -> dict:
    """selection.json and each trial's release.json, from each trial's folder and score (None: failed, the worst)."""
    from dpmem.privacy import composed_epsilon
    from dpmem.privacy.selection import law

    done = [i for i, (_, s) in enumerate(results) if s is not None and math.isfinite(s)]  # (None: failed; NaN, inf)
    best = (min if search.minimise else max)(done, key=lambda i: results[i][1]) if done else None
    summaries = []
    for run_dir, _ in results:
        try:
            summaries.append(json.loads((run_dir / "summary.json").read_text()))
        except (OSError, ValueError):
            summaries.append(None)
    low = [str(r.name) for (r, _), s in zip(results, summaries) if s and (s.get("sigma") or 0) < search.sigma]
    if low:  # a trial ran with less noise than the selection's ε needs: nothing here may be released under it
        best = None
    ended = ("completed" if best is not None else "no trial drawn (Poisson law)" if not results
             else f"no release: trials {', '.join(low)} ran with less noise than the selection needs" if low
             else "no release: every trial failed")
    record = {"winner": results[best][0].name if best is not None else None,
              "epsilon": search.epsilon if best is not None else 0.0, "delta": search.delta,
              "mean_trials": search.mean, "shape": search.shape, "law": law(search.shape),
              "accountant": "rdp (dp-accounting RepeatAndSelectDpEvent)", "neighbouring": search.neighbouring,
              "trial_sigma": search.sigma, "trial_epsilon": search.trial_epsilon,
              "score": f"{search.objective} ({'lowest' if search.minimise else 'highest'} wins)",
              "ended": ended}
    (folder / SELECTION).write_text(json.dumps(record, indent=2) + "\n")
    runs = [{"sigma": s.get("sigma_accounted") or s.get("sigma") or 0.0, "sample_rate": s["sample_rate"],
             "steps": s.get("steps_done") or 0, "sampling": s.get("sampling", "poisson"),
             "dataset_size": s.get("n_train")} for s in summaries if s and s.get("sample_rate")]
    try:
        together = composed_epsilon(runs, search.delta, search.accountant, search.neighbouring) if runs else 0.0
    except ValueError:
        together = math.inf
    for i, (run_dir, _) in enumerate(results):
        if not run_dir.is_dir():
            continue
        release = {"for_release": i == best, "selection": f"../{SELECTION}", "delta": search.delta}
        release.update({"epsilon": search.epsilon} if i == best else
                       {"why": "a trial of a private search: only its winner is released under the search's ε",
                        "epsilon_if_released_too": together,
                        "accountant": f"{search.accountant}, every trial of the search composed (as dpmem report)"})
        (run_dir / RELEASE).write_text(json.dumps(release, indent=2) + "\n")
    return record
