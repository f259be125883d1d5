"""`dpmem train`'s checks before Hydra launches anything (`preflight`), so that a bad key or interval ends in one
line before any trial runs, and what a search optimises (`objective`)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from dpmem import distributed
from dpmem.composition import (ABSENT, MAX_PREFLIGHT, compose_point, compose_points, direction, first_line, groups,
                               initialized, quoting, select, sweep_points)
from dpmem.config import ConfigError, enum_value
from dpmem.engine.folder import given


def preflight(overrides: list[str]) -> None:
    """Check group options and compose every sweep point (up to MAX_PREFLIGHT), and a sweeper's search space;
    print each warning the points' methods have (once). Raises ConfigError."""
    from dpmem.methods import method_class

    hydra_args, _ = _split(overrides)
    try:  # Hydra's own settings (hydra.run.dir=...) are read by the same grammar, later, with a traceback
        parsed = OverridesParser.create().parse_overrides(hydra_args)
    except Exception as e:  # noqa: BLE001  (hydra's OverrideParseException and friends)
        raise ConfigError("override", str(e).splitlines()[0] + quoting(hydra_args)) from None
    for o in parsed:  # Hydra refuses a sweep among its own settings ("requires --multirun", with -m given)
        if o.is_sweep_override():
            key, value = o.input_line.split("=", 1)
            plain = key.removeprefix("hydra.sweeper.params.")
            raise ConfigError(key, "a Hydra setting takes one value, not a sweep" + (
                f": give the search space as {plain}={value} (the sweeper draws it the same)" if plain != key else ""))
    cfgs = compose_points(sweep_points(overrides)[:MAX_PREFLIGHT])
    if any(a in ("-m", "--multirun") for a in overrides):
        check_search_space(overrides)
        if "hydra/sweeper=private" in overrides:
            check_private_search(overrides)
    if distributed.is_main():
        for warning in dict.fromkeys(w for cfg in cfgs for w in method_class(cfg.method.name).warnings(cfg)):
            print(f"dpmem: warning: {warning}", file=sys.stderr)


def _split(overrides: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's own settings (hydra.run.dir=..., hydra/launcher=...) and the task's overrides, -m left out."""
    plain = [o for o in overrides if o not in ("-m", "--multirun")]
    hydra_args = [o for o in plain if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    return hydra_args, [o for o in plain if o not in hydra_args]


def check_search_space(overrides: list[str]) -> None:
    """A sweeper's search space, before the search starts (Optuna and Hydra would refuse it with their own errors
    once it has): the command line's sweeps and `hydra.sweeper.params` name keys of the config (or, with a leading
    +, add one), and a log-scale interval lies above 0. Raises ConfigError naming the key."""
    hydra_args, task = _split(overrides)
    try:
        with initialized():
            cfg = compose("config", overrides=sweep_points(overrides)[0] + hydra_args, return_hydra_config=True)
    except Exception:  # noqa: BLE001  (a setting of Hydra's own: Hydra reports it as it starts)
        return
    space = {}
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None)
    if isinstance(params, DictConfig):
        space.update((str(k), str(v)) for k, v in OmegaConf.to_container(params, resolve=False).items())
    parser = OverridesParser.create()
    space.update(o.input_line.split("=", 1) for o in parser.parse_overrides(task) if o.is_sweep_override())
    options = groups()
    for key, value in space.items():
        try:
            (o,) = parser.parse_overrides([f"{key}={value}"])
        except Exception as e:  # noqa: BLE001  (hydra's OverrideParseException)
            raise ConfigError(key, f"{value!r} is not a value or sweep Hydra reads ({first_line(e)})") from None
        name = key.lstrip("~")
        if name.startswith("+") or name in options or "/" in name:
            continue  # a key added, or a config group (whose options sweep_points checks on the command line)
        if select(cfg, name) is ABSENT:
            parent = name.rpartition(".")[0]
            while parent and not isinstance(select(cfg, parent), DictConfig):
                parent = parent.rpartition(".")[0]  # the nearest section that exists lists its keys
            node = OmegaConf.select(cfg, parent) if parent else cfg
            leaf = name[len(parent) + 1 if parent else 0:].split(".")[0]
            allowed = sorted(k for k in node.keys() if k != "hydra")
            if leaf in allowed:  # a value (method.betas.x)
                raise ConfigError(name, f"in the search space: {parent + '.' if parent else ''}{leaf} is a value, "
                                  "not a section with keys")
            what = f"{node['name']} has no option {leaf!r}" if parent == "method" else "not a key of the config"
            raise ConfigError(name, f"in the search space: {what}; allowed{' in ' + parent if parent else ''}: "
                              f"{', '.join(allowed)}")
        if o.is_interval_sweep():
            interval = o.value()
            if (isinstance(current := select(cfg, name), int) and not isinstance(current, bool)
                    and not (isinstance(interval.start, int) and isinstance(interval.end, int))):
                raise ConfigError(name, f"{value}: takes whole numbers, and interval() draws real ones; cast it: "
                                  f"int(interval({interval.start:g}, {interval.end:g}))")
            if interval.start > interval.end:
                raise ConfigError(name, f"{value}: the interval's lower bound is above its upper bound")
            if "log" in interval.tags and interval.start <= 0:
                raise ConfigError(name, f"{value}: a log-scale interval needs a lower bound > 0 (its logarithm is "
                                  "drawn uniformly), e.g. "
                                  f"tag(log, interval({interval.end * 1e-3:g}, {interval.end:g}))")


def check_private_search(overrides: list[str]) -> None:
    """`dpmem train -m hydra/sweeper=private ...`, composed as Hydra will compose it and checked before Hydra starts:
    the law, the space, the score, the budget, a resumed folder's search. Raises ConfigError."""
    from dpmem.engine.selection import check_folder, describe, parse_space, plan_search

    hydra_args, task = _split(overrides)
    with initialized():
        sweeper = compose("config", overrides=hydra_args, return_hydra_config=True).hydra.sweeper
        params = OmegaConf.to_container(sweeper.params, resolve=False) if sweeper.get("params") else None
        fixed, dims = parse_space(task, params)
        cfg = compose_point(fixed)  # the fixed overrides: what every trial shares
    search = plan_search(cfg, sweeper.mean_trials, sweeper.shape, task)
    folder = given(hydra_args, "hydra.sweep.dir")
    if folder is not None:  # a new folder, or the same search resumed: anything else is refused now
        check_folder(Path(folder).expanduser().absolute(), describe(search, fixed, dims))
    per = " per user" if search.unit == "user" else ""
    print(f"dpmem: private search: ε = {search.epsilon:g}{per}, δ = {search.delta:.3g} for the whole search (each "
          f"trial σ = {search.sigma:.4g}, ε = {search.trial_epsilon:.4g} alone), {len(dims)} hyperparameter(s) drawn",
          file=sys.stderr)


def objective(cfg, summary: dict | None) -> float:
    """What a sweeper optimises (train.objective): the final metric or the last logged training loss; for a run
    that did not finish ok, the worst value in the sweeper's direction (-inf when it maximises, inf when it
    minimises), so that the search records it as bad and goes on (Optuna 2 refuses NaN)."""
    name = enum_value(cfg.train.objective)
    ok = summary is not None and summary.get("status") == "ok"
    value = summary["metric_final" if name == "metric" else "train_loss"] if ok else None
    if value is not None:
        return float(value)
    way = HydraConfig.get().sweeper.get("direction") if HydraConfig.initialized() else None
    return -math.inf if str(way or direction(name)).lower().endswith("maximize") else math.inf
