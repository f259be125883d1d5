"""`dpmem train`'s checks before Hydra launches anything, and what a search optimises: every sweep point composed
(`preflight`), and the search space of a Hydra sweeper (hydra/sweeper=search's Optuna, or hydra/sweeper=private,
`dpmem.engine.selection`) checked against the config, so that a bad key or interval ends in one line before any
trial runs; and each trial's objective."""

from __future__ import annotations

import math
import sys

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from dpmem import distributed
from dpmem.composition import (ABSENT, CONF_DIR, MAX_PREFLIGHT, compose_point, compose_points, direction, first_line,
                               groups, quoting, select, sweep_points)
from dpmem.config import ConfigError, enum_value


def preflight(overrides: list[str]) -> None:
    """Check group options and compose every sweep point (up to MAX_PREFLIGHT), and a sweeper's search space;
    print each warning the points' methods have (once). Raises ConfigError."""
    from dpmem.methods import method_class

    hydra_args = [o for o in overrides if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:  # Hydra's own settings (hydra.run.dir=...) are read by the same grammar, later, with a traceback
        OverridesParser.create().parse_overrides(hydra_args)
    except Exception as e:  # noqa: BLE001  (hydra's OverrideParseException and friends)
        raise ConfigError("override", str(e).splitlines()[0] + quoting(hydra_args)) from None
    cfgs = compose_points(sweep_points(overrides)[:MAX_PREFLIGHT])
    if any(a in ("-m", "--multirun") for a in overrides):
        check_search_space(overrides)
        if "hydra/sweeper=private" in overrides:
            check_private_search(overrides)
    if distributed.is_main():
        for warning in dict.fromkeys(w for cfg in cfgs for w in method_class(cfg.method.name).warnings(cfg)):
            print(f"dpmem: warning: {warning}", file=sys.stderr)


def check_search_space(overrides: list[str]) -> None:
    """A sweeper's search space, before the search starts (Optuna and Hydra would refuse it with their own errors
    once it has): the sweep overrides on the command line and `hydra.sweeper.params` (an experiment's, or given as
    an override) name keys of the config (or, with a leading +, add one), and a log-scale interval lies above 0.
    Raises ConfigError naming the key."""
    plain = [o for o in overrides if o not in ("-m", "--multirun")]
    hydra_args = [o for o in plain if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose("config", overrides=sweep_points(overrides)[0] + hydra_args, return_hydra_config=True)
    except Exception:  # noqa: BLE001  (a setting of Hydra's own: Hydra reports it as it starts)
        return
    finally:
        GlobalHydra.instance().clear()
    space = {}
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None)
    if isinstance(params, DictConfig):
        space.update((str(k), str(v)) for k, v in OmegaConf.to_container(params, resolve=False).items())
    parser = OverridesParser.create()
    for o in parser.parse_overrides([o for o in plain if o not in hydra_args]):
        if o.is_sweep_override():
            space[o.input_line.split("=", 1)[0]] = o.input_line.split("=", 1)[1]
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
            current = select(cfg, name)
            if (isinstance(current, int) and not isinstance(current, bool)
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
    """hydra/sweeper=private's search (dpmem.engine.selection), composed as Hydra will compose it. Raises
    ConfigError."""
    from dpmem.engine.selection import check_before_start, parse_space

    plain = [o for o in overrides if o not in ("-m", "--multirun")]
    hydra_args = [o for o in plain if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    task = [o for o in plain if o not in hydra_args]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            sweeper = compose("config", overrides=hydra_args, return_hydra_config=True).hydra.sweeper
            params = OmegaConf.to_container(sweeper.params, resolve=False) if sweeper.get("params") else None
            cfg = compose_point(parse_space(task, params)[0])  # the fixed overrides: what every trial shares
    finally:
        GlobalHydra.instance().clear()
    check_before_start(cfg, sweeper, task, hydra_args)


def objective(cfg, summary: dict | None) -> float:
    """What a sweeper optimises (train.objective): the final metric or the last logged training loss; for a run
    that did not finish ok, the worst value in the sweeper's direction (-inf when it maximises, inf when it
    minimises), so that the search records it as bad and goes on (Optuna 2 refuses NaN)."""
    name = enum_value(cfg.train.objective)
    value = None
    if summary is not None and summary.get("status") == "ok":
        value = summary["metric_final"] if name == "metric" else summary["train_loss"]
    if value is not None:
        return float(value)
    way = HydraConfig.get().sweeper.get("direction") if HydraConfig.initialized() else None
    return -math.inf if str(way or direction(name)).lower().endswith("maximize") else math.inf
