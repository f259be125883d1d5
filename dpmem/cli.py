"""`dpmem VERB [hydra overrides]`: one Hydra app per verb, kept thin.

Before Hydra runs, the overrides are checked against the config groups and composed once per sweep point, so a
bad value ends in one line that names the key and what is allowed (exit 2), not a traceback. `debug=true`
shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from dpmem import distributed
from dpmem.config import ConfigError, MethodConfig, enum_value, register_configs
from dpmem.engine.placement import cuda_device_count, place_job

CONF_DIR = str(Path(__file__).resolve().parent / "conf")  # inside the package: works from any install
USAGE = """usage: dpmem train [-m] [key=value ...]
       dpmem memory [key=value ...]
       dpmem plan [key=value ...]
       dpmem spectrum mode=layer|trajectory [key=value ...]
       dpmem audit [key=value ...]
       dpmem report PATH... [--out DIR] [--published] [--select top3]

  dpmem train                                      the embedded default (ViT on digits, grape, eps=8)
  dpmem train method=adam privacy=none             a non-private baseline
  dpmem train -m method=dp-adam,grape privacy=eps2,eps8  a sweep (one run folder each)
  dpmem train --help                               every config group and option
  torchrun --nproc_per_node=2 -m dpmem train ...   one run data-parallel over 2 processes (GPUs)
  dpmem memory model=opt-6.7b data=synthetic method=dp-adam,grape train.batch_size=1,2,4
                                                   plan peak memory on the meta device (no weights)
  dpmem memory model=vit-base data=synthetic method=dp-adam,grape memory.budget=24GB
                                                   the largest batch that fits, per method
  dpmem plan model=roberta-large data=synthetic memory.budget=24GB plan.device=l4
                                                   the fastest configuration that fits a GPU (estimated)
  dpmem spectrum mode=layer spectrum.clip=[null,1.0] spectrum.sigma=[0,0.5,2.0]
                                                   singular values of each layer's (clipped, noised) gradient
  dpmem spectrum mode=trajectory method=dp-adam    PCA of a private run's clipped gradients, and subspace.pt
  dpmem audit method=dp-adam,grape privacy=eps2 audit.canaries=1000
                                                   one run each with m canaries: an empirical lower bound on epsilon
  dpmem report outputs/multirun/DATE               the runs' summaries as tables (method x epsilon, tasks)

Documentation (Markdown in the repository's docs/; `mkdocs serve` shows it as a site):
  docs/getting-started.md   install, a run and its folder, configuration, sweeps, dpmem report
  docs/scale.md             torchrun, FSDP, Hydra's launchers, SLURM, the Optuna search
  docs/methods.md           the private step, clipping modes, each method, precision, train.compile
  docs/memory.md            dpmem memory: planned peaks, budgets, the largest batch that fits
  docs/plan.md              dpmem plan: choosing a configuration for a GPU
  docs/privacy.md           accounting, secret seeds, what a run releases, the ledger, dpmem audit
  docs/sharp-edges.md       DP pitfalls: what dpmem guards against and what it cannot
  docs/reproductions.md     the papers' experiments (experiment=...), dpmem spectrum
  docs/api.md               the Python API for a training loop of your own
"""
# the page each verb's --help points to
VERB_DOCS = {"train": "docs/getting-started.md", "memory": "docs/memory.md", "plan": "docs/plan.md",
             "spectrum": "docs/reproductions.md", "audit": "docs/privacy.md", "report": "docs/getting-started.md"}
MAX_PREFLIGHT = 256  # sweep points composed before launch; larger grids are checked per job

register_configs()
OmegaConf.register_new_resolver("dpmem.cuda_device_count", cuda_device_count, replace=True)  # hydra/launcher=local
_failed: list[str] = []  # runs of this process's sweep that did not end ok
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
_launched_at: str | None = None


class RunFailed(RuntimeError):
    """A run under a launcher ended without an exception but not ok (out of memory): its job fails."""


def _launch_time(pattern: str) -> str:
    """`${launch_time:%H-%M-%S}` in run folder names: the time `dpmem train` started, on rank 0 (torchrun's ranks
    start at slightly different times, and must name one folder)."""
    global _launched_at
    if _launched_at is None:
        _launched_at = distributed.from_main(datetime.now().isoformat())
    return datetime.fromisoformat(_launched_at).strftime(pattern)


OmegaConf.register_new_resolver("launch_time", _launch_time, use_cache=True, replace=True)


def _groups() -> dict[str, list[str]]:
    conf = Path(CONF_DIR)
    # options in sub-folders are named by their path: experiment=spectrum/layer-vit-digits; conf/hydra holds
    # Hydra's own groups (hydra/launcher=slurm), which Hydra checks
    return {d.name: sorted(f.relative_to(d).with_suffix("").as_posix() for f in d.rglob("*.yaml"))
            for d in conf.iterdir() if d.is_dir() and d.name != "hydra"}


def _error(message: str) -> "SystemExit":
    print(f"dpmem: error: {message}", file=sys.stderr)
    return SystemExit(2)


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """Every point of the sweep the overrides describe (`a=1,2 b=3,4`: four points), group options checked.
    Raises ConfigError."""
    plain = [o for o in overrides if not o.lstrip("+~").startswith(("-", "hydra.", "hydra/"))]
    try:
        parsed = OverridesParser.create().parse_overrides(plain)
    except Exception as e:  # hydra's OverrideParseException and friends
        raise ConfigError("override", str(e).splitlines()[0] + _quoting(plain)) from None
    groups = _groups()
    choices = []
    for o in parsed:
        if o.is_interval_sweep():  # interval(a, b): a sweeper (optuna) draws the value; each trial checks its own
            continue
        key = o.key_or_group.lstrip("+~")
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        if key in groups:
            for v in values:
                if v not in groups[key]:
                    raise ConfigError(key, f"unknown option {v!r}; allowed: {', '.join(groups[key])}")
        prefix = o.input_line.split("=", 1)[0]
        choices.append([f"{prefix}={v}" for v in values])
    return [list(point) for point in itertools.product(*choices)]


def _quoting(overrides: list[str]) -> str:
    """How to quote what Hydra's override grammar did not read, where an override shows why."""
    if any(o.startswith("plan.candidates=") for o in overrides):
        return ("; quote each candidate, and the list for the shell: "
                "'plan.candidates=[\"method=grape\",\"method=dp-adam method.clipping=ghost\"]'")
    if any(not o.isascii() for o in overrides):
        return "; a value with characters beyond ASCII is quoted for Hydra: 'key=\"välue\"' (shell quotes outside)"
    return ""


def compose_point(point: list[str]) -> DictConfig:
    """The validated config of one sweep point (inside an initialised Hydra). Raises ConfigError."""
    try:
        cfg = compose("config", overrides=point)
    except Exception as e:  # hydra wraps OmegaConf's validation error (once or twice), which names the key
        cause = e
        while cause is not None and not (isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", 0)):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:  # a key set in a config file: say which file ("In 'hp/table7/dp-adam-mnist'")
            where = _first_line(e).split(":")[0] + ": " if _first_line(e).startswith("In '") else ""
            raise ConfigError(cause.full_key, where + _key_message(cause)) from None
        raise ConfigError("override", _first_line(e)) from None
    from dpmem.methods import validate  # lazily, as each verb's modules (the methods pull in transformers)

    validate(cfg)
    return cfg


def compose_points(points: list[list[str]]) -> list[DictConfig]:
    """The validated config of each sweep point, outside any Hydra app. Raises ConfigError."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return [compose_point(point) for point in points]
    finally:
        GlobalHydra.instance().clear()


def preflight(overrides: list[str]) -> None:
    """Check group options and compose every sweep point (up to MAX_PREFLIGHT), and a sweeper's search space;
    print each warning the points' methods have (once). Raises ConfigError."""
    from dpmem.methods import method_class

    hydra_args = [o for o in overrides if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:  # Hydra's own settings (hydra.run.dir=...) are read by the same grammar, later, with a traceback
        OverridesParser.create().parse_overrides(hydra_args)
    except Exception as e:  # noqa: BLE001  (hydra's OverrideParseException and friends)
        raise ConfigError("override", str(e).splitlines()[0] + _quoting(hydra_args)) from None
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
    groups = _groups()
    for key, value in space.items():
        try:
            (o,) = parser.parse_overrides([f"{key}={value}"])
        except Exception as e:  # noqa: BLE001  (hydra's OverrideParseException)
            raise ConfigError(key, f"{value!r} is not a value or sweep Hydra reads ({_first_line(e)})") from None
        name = key.lstrip("~")
        if name.startswith("+") or name in groups or "/" in name:
            continue  # a key added, or a config group (whose options sweep_points checks on the command line)
        if _select(cfg, name) is _ABSENT:
            parent = name.rpartition(".")[0]
            while parent and not isinstance(_select(cfg, parent), DictConfig):
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
            current = _select(cfg, name)
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


_ABSENT = object()


def _select(cfg: DictConfig, key: str):
    """The node at `key` (a value, or a section), or _ABSENT where there is none."""
    try:
        return OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False)
    except OmegaConfBaseException:  # e.g. a list indexed by a name
        return _ABSENT


def _first_line(e: Exception) -> str:
    msg = getattr(e, "msg", None) or str(e)
    return msg.strip().splitlines()[0].strip()


def _key_message(e: OmegaConfBaseException) -> str:
    """OmegaConf's message; for an unknown key, the keys its section allows (a method's own options, for
    method.KEY)."""
    if not isinstance(e, (ConfigAttributeError, ConfigKeyError)):
        return _first_line(e)
    schema = getattr(e, "object_type", None)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return _first_line(e)
    allowed = "; allowed: " + ", ".join(sorted(f.name for f in dataclasses.fields(schema)))
    node = getattr(e, "parent_node", None)
    if issubclass(schema, MethodConfig) and node is not None and "name" in node:
        return f"{node['name']} has no option {e.key!r}" + allowed
    return _first_line(e) + allowed


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
    direction = HydraConfig.get().sweeper.get("direction") if HydraConfig.initialized() else None
    return -math.inf if str(direction or _direction(name)).lower().endswith("maximize") else math.inf


def _direction(objective_name: str) -> str:
    """hydra/sweeper=search's direction for train.objective (a loss metric, as data=median's, needs
    hydra.sweeper.direction=minimize)."""
    return "minimize" if enum_value(objective_name) == "train_loss" else "maximize"


OmegaConf.register_new_resolver("dpmem.direction", _direction, replace=True)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
def _train(cfg: DictConfig) -> float:
    from dpmem.engine.folder import FolderRefused, drop_if_empty, skip_done
    from dpmem.engine.summary import DiskFull
    from dpmem.engine.trainer import Terminated, run_training
    from dpmem.methods import validate

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    # a launcher's job (joblib, submitit) runs in another process: its failure is raised, so that Hydra marks the
    # job failed and the sweep, once its other jobs are done, exits non-zero
    here = not multirun or hc.launcher._target_ == BASIC_LAUNCHER
    try:
        try:
            # done with this configuration (another one's finished run is refused); unreadable: not done
            done = skip_done(cfg, run_dir) if cfg.train.skip_done else None
            if done is not None:
                print(f"dpmem: {run_dir} is done (status ok, the same configuration), skipped (train.skip_done)",
                      file=sys.stderr)
                return objective(cfg, done)
            if multirun:  # a launcher that runs jobs side by side on one machine: one GPU each, not all on GPU 0
                place_job(hc.launcher._target_, hc.job.num, enum_value(cfg.train.device))
            validate(cfg)
            summary = run_training(cfg, run_dir)
        except ConfigError:
            drop_if_empty(run_dir)  # found after Hydra made the folder: no empty folder is left behind
            raise
    except ConfigError as e:  # this run only (a refused folder, a value a sweeper drew): a sweep goes on
        if cfg.debug:
            raise
        if not multirun:
            raise _error(str(e)) from None
        what = "refused" if isinstance(e, FolderRefused) else "failed"
        if not here:
            raise RunFailed(f"run {run_dir} {what}: {e}") from None
        print(f"dpmem: run {run_dir} {what}: {e}", file=sys.stderr)
        _failed.append(str(run_dir))
        return objective(cfg, None)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Terminated:
        raise SystemExit(143) from None  # 128 + SIGTERM, as if the signal had ended the process
    except Exception as e:
        if isinstance(e, DiskFull) and not multirun and not cfg.debug:  # the summary says failed; one line here
            print(f"dpmem: error: run {run_dir} failed: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        if not multirun or cfg.debug or not here:
            raise
        # a sweep goes on past a failed run; its summary.json says why, and the exit code says so at the end
        print(f"dpmem: run {run_dir} failed: {type(e).__name__}: {e}", file=sys.stderr)
        _failed.append(str(run_dir))
        return objective(cfg, None)
    if summary["status"] != "ok":
        if not here:
            raise RunFailed(f"run {run_dir} ended with status {summary['status']}: {summary['error']}")
        _failed.append(str(run_dir))
    return objective(cfg, summary)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return
    verb, rest = argv[0], argv[1:]
    if verb not in ("train", "report") and distributed.launched():
        raise _error(f"dpmem {verb} runs in one process; only dpmem train runs under torchrun")
    if verb == "memory":
        return _memory(rest)
    if verb == "plan":
        return _plan(rest)
    if verb == "spectrum":
        return _spectrum(rest)
    if verb == "report":
        return _report(rest)
    if verb == "audit":
        return _audit(rest)
    if verb != "train":
        raise _error(f"unknown command {verb!r}; allowed: train, memory, plan, spectrum, audit, report")
    distributed.init_from_env()
    try:
        _train_main(rest)
        distributed.settle()
    finally:
        distributed.close()


def _train_help(rest: list[str]) -> None:
    """`dpmem train [overrides] --help`: the config groups users choose from (not the schemas dpmem registers for
    validation, which Hydra's help would list) and the config the overrides compose."""
    with _one_line_errors(_is_debug(rest)):
        cfg = compose_points(sweep_points([a for a in rest if a not in ("-h", "--help", "-m", "--multirun")])[:1])[0]
    lines = [USAGE.splitlines()[0].replace("usage: ", ""), "",
             f"Documented in {VERB_DOCS['train']} (running), docs/methods.md (methods and their options) and "
             "docs/privacy.md (privacy.*)", "", "== Configuration groups ==",
             "Compose your configuration from those groups (group=option)", ""]
    for group, options in sorted(_groups().items()):
        by_folder: dict[str, list[str]] = {}
        for option in options:
            folder, _, name = option.rpartition("/")
            by_folder.setdefault(f"{group}/{folder}" if folder else group, []).append(name)
        lines += [f"{where}: {', '.join(names)}" for where, names in sorted(by_folder.items())]
    lines += ["", "== Config ==", "Override anything in the config (foo.bar=value)", "", OmegaConf.to_yaml(cfg)]
    print("\n".join(lines), end="")


def _train_main(rest: list[str]) -> None:
    if any(a in ("-h", "--help") for a in rest):
        return _train_help(rest)
    if not any(a in ("--help", "-h", "--hydra-help", "--info", "-i") or a.startswith("--cfg") or a == "-c"
               for a in rest):
        with _one_line_errors(_is_debug(rest)):
            preflight(rest)
            if distributed.is_main():
                key = "hydra.sweep.dir" if any(a in ("-m", "--multirun") for a in rest) else "hydra.run.dir"
                given = _given(rest, key)
                _check_output(key, "outputs" if given is None else given)
    if not distributed.is_main():  # rank 0 alone speaks for Hydra (and writes the run folder)
        rest = rest + ["hydra/hydra_logging=none"]
    sys.argv = [f"{Path(sys.argv[0]).name} train"] + rest
    _train()
    if _failed:
        raise _error(f"{len(_failed)} run(s) did not finish ok: {', '.join(_failed)}")


def _given(overrides: list[str], key: str) -> str | None:
    """The last value of `key=...` among the overrides, if any."""
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    return values[-1] if values else None


def _check_output(key: str, name: str) -> None:
    """Before anything is made: the folder `name` (its part before any ${...}) can be made, that is, its nearest
    existing ancestor is a folder this process can create folders in. Raises ConfigError naming the key."""
    if not name.strip():
        raise ConfigError(key, "is empty, which would write into the current folder; name a folder "
                          f"({key}=outputs/my-run) or leave it out for a new dated one")
    base = Path(name.split("${")[0] or ".").expanduser().absolute()
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise ConfigError(key, f"{name}: {base} is a file, not a folder")
    try:
        tempfile.TemporaryDirectory(dir=base, prefix=".dpmem-check-").cleanup()
    except OSError as e:
        raise ConfigError(key, f"{name}: cannot make a folder in {base} ({e.strerror or type(e).__name__}); "
                          "name a folder you can write") from None


def _out_dir(overrides: list[str], alias_key: str, alias: str | None, dated: str) -> Path:
    """Where memory, spectrum and audit write: hydra.run.dir=..., as for train, else their own *.dir, else a dated
    folder under outputs/; checked writable, and absolute (as train's run_dir is in its summary)."""
    given = _given(overrides, "hydra.run.dir")
    key, name = ("hydra.run.dir", given) if given is not None else (alias_key, alias or datetime.now().strftime(dated))
    _check_output(key, name)
    return Path(name).expanduser().absolute()


def _dir_key(overrides: list[str], alias_key: str) -> str:
    """The key that named a tool's output folder, for its messages: hydra.run.dir if given, else its alias."""
    return "hydra.run.dir" if _given(overrides, "hydra.run.dir") is not None else alias_key


def _is_debug(args: list[str]) -> bool:
    return any(a.lower() in ("debug=true", "debug=1") for a in args)


def _verb_help(verb: str) -> None:
    """A verb's --help: the usage, and the page of the documentation about it."""
    print(USAGE + f"\ndpmem {verb}: {VERB_DOCS[verb]}\n", end="")


def _sweep_overrides(argv: list[str], verb: str) -> list[str] | None:
    """The overrides of a verb that sweeps comma lists itself (memory, spectrum, audit: -m is implied), or None
    after printing the verb's help for -h/--help."""
    if any(a in ("-h", "--help") for a in argv):
        _verb_help(verb)
        return None
    return [a for a in argv if a not in ("-m", "--multirun")]


@contextlib.contextmanager
def _one_line_errors(debug: bool):
    """A ConfigError ends the command with one line (exit 2); debug=true shows its traceback instead."""
    try:
        yield
    except ConfigError as e:
        if debug:
            raise
        raise _error(str(e)) from None


def _memory(argv: list[str]) -> None:
    """`dpmem memory`: plan every point of the sweep (comma lists, with or without -m) into one folder."""
    from dpmem.engine.folder import FolderLock, check_owner, mark
    from dpmem.engine.planner import SEARCH_LIMIT, largest_batch, parse_bytes, plan
    from dpmem.report import memory as report

    overrides = _sweep_overrides(argv, "memory")
    if overrides is None:
        return
    with _one_line_errors(_is_debug(overrides)), contextlib.ExitStack() as held:
        points = sweep_points(overrides)
        cfgs = compose_points(points)
        labels = _labels(points, cfgs, skip="train.batch_size=")
        mem = cfgs[0].memory
        out = _out_dir(overrides, "memory.dir", mem.dir, "outputs/memory/%Y-%m-%d/%H-%M-%S")
        held.enter_context(FolderLock(out))  # one writer (at the end released, and a folder it made left empty removed)
        check_owner(out, "memory", cfgs[0].train.overwrite, _dir_key(overrides, "memory.dir"))
        rows, found = [], None
        if mem.budget is None:
            for label, cfg in zip(labels, cfgs):
                rows.append(row := {"label": label, **plan(cfg)})
                print(f"dpmem memory: {label} B={row['batch_size']}: peak {row['peak_bytes'] / 2**30:.2f} GiB "
                      f"(training {row['training']['peak_bytes'] / 2**30:.2f}, evaluation at B="
                      f"{row['evaluation']['batch_size']} {row['evaluation']['peak_bytes'] / 2**30:.2f})",
                      file=sys.stderr)
        else:
            budget, found = parse_bytes(mem.budget), []
            for label in dict.fromkeys(labels):  # batch sizes are searched, not taken from the overrides
                cfg = cfgs[labels.index(label)]
                batch, at = largest_batch(cfg, budget)
                capped = batch >= SEARCH_LIMIT
                found.append({"label": label, "largest_batch": batch, "capped": capped, "plan": {"label": label, **at}})
                print(f"dpmem memory: {label}: largest batch {batch}" + (
                    " (where the search stops: larger batches fit too)" if capped else ""), file=sys.stderr)
        mark(out, "memory")
        print(report.write(out, rows, mem.budget, found), end="")
    print(f"dpmem memory: wrote {', '.join(sorted(f.name for f in out.iterdir() if not f.name.startswith('.')))} "
          f"to {out}", file=sys.stderr)


def _plan(argv: list[str]) -> None:
    """`dpmem plan`: the candidates of one setting, planned, timed and ranked into one folder."""
    from dpmem.engine.chooser import choose
    from dpmem.engine.folder import FolderLock, check_owner, mark, owner
    from dpmem.engine.planner import parse_bytes
    from dpmem.engine.roofline import device as plan_device
    from dpmem.report import plan as report

    overrides = _sweep_overrides(argv, "plan")
    if overrides is None:
        return
    with _one_line_errors(_is_debug(overrides)), contextlib.ExitStack() as held:
        if len(sweep_points(overrides)) > 1:
            raise ConfigError("override", "dpmem plan plans one setting (no comma lists): the configurations it "
                              "compares are plan.candidates × plan.checkpointing × plan.precisions")
        cfg = compose_points([overrides])[0]
        pc = cfg.plan
        device = plan_device(enum_value(pc.device))
        budget = parse_bytes(cfg.memory.budget) if cfg.memory.budget is not None else (
            int(device.memory_gib * 2**30) if device.name != "cpu" else _host_memory())
        if enum_value(cfg.memory.device) != "meta" or cfg.memory.world_size != 1:
            raise ConfigError("memory.device" if enum_value(cfg.memory.device) != "meta" else "memory.world_size",
                              "dpmem plan plans one GPU on meta (memory.device=meta, memory.world_size=1); the GPU "
                              "it plans for is plan.device")
        _reachable(cfg)
        out = _out_dir(overrides, "plan.dir", pc.dir, "outputs/plan/%Y-%m-%d/%H-%M-%S")
        held.enter_context(FolderLock(out))
        if owner(out) == "train":  # train.overwrite=true or not: plan.json beside it would end its resume
            raise ConfigError(_dir_key(overrides, "plan.dir"), f"{out} holds a training run: dpmem plan never writes "
                              "into one; give another plan.dir")
        check_owner(out, "plan", cfg.train.overwrite, _dir_key(overrides, "plan.dir"))
        # the GPU's plan counts CUDA's allocation blocks and kernels; the cpu's exact bytes and the CPU's kernels
        target = ["memory.target=cpu"] if device.name == "cpu" else ["memory.target=cuda"]
        result = choose(lambda extra: compose_points([[*overrides, *target, *extra]])[0], overrides, budget, device)
        fitting = [r for r in result["rows"] if r["fits"]]
        if result["interrupted"]:  # Ctrl-C: what was planned is kept, as train keeps its run
            if fitting:
                mark(out, "plan")
                report.write(out, result, overrides, pc.top)
            print(f"dpmem plan: interrupted after {len(result['rows'])} planned candidate(s)"
                  + (f"; wrote them to {out}" if fitting else "; none fitted, nothing written"), file=sys.stderr)
            raise SystemExit(130)
        if not fitting:
            smallest = min(result["rows"], key=lambda r: r["reserved_estimate_bytes"], default=None)
            raise ConfigError("memory.budget", f"nothing fits {_bytes(budget)}" + (
                f": the smallest peak is ≥ {_bytes(smallest['peak_bytes'])} (reserved estimate ≥ "
                f"{_bytes(smallest['reserved_estimate_bytes'])}), {smallest['configuration']} at physical "
                "batch 1" if smallest else
                ": every candidate was refused (see plan.candidates)"))
        mark(out, "plan")
        print(report.write(out, result, overrides, pc.top), end="")
    print(f"dpmem plan: wrote {', '.join(sorted(f.name for f in out.iterdir() if not f.name.startswith('.')))} "
          f"to {out}", file=sys.stderr)


def _reachable(cfg) -> None:
    """The base config's privacy.epsilon, calibrated once before any candidate is planned: a budget no noise meets
    (or one so loose it protects nothing) is refused under its key at once, not after every candidate. Raises
    ConfigError."""
    from dpmem.engine.ledger import resolve_accountant
    from dpmem.engine.trainer import accounting_of
    from dpmem.methods import method_class
    from dpmem.privacy import UnreachableTarget, calibrate_sigma

    if cfg.privacy.epsilon is None or not method_class(cfg.method.name).private or resolve_accountant(cfg) == "rc":
        return
    try:
        calibrate_sigma(cfg.privacy.epsilon, **accounting_of(cfg))
    except UnreachableTarget as e:
        raise ConfigError("privacy.epsilon", str(e)) from None


def _bytes(n: float) -> str:
    """A size in the largest binary unit it reaches: 24 GiB, 3 MiB, 100 KiB."""
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if n >= s), ("B", 1))
    return f"{n / scale:.3g} {unit}"


def _host_memory() -> int:
    """This host's RAM in bytes (the budget of a plan for plan.device=cpu when memory.budget is not given)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _labels(points: list[tuple[str, ...]], cfgs, skip: str | None = None) -> list[str]:
    """Each sweep point named by the overrides that vary across the sweep (the method's name when none do)."""
    varying = [i for i in range(len(points[0])) if len({p[i] for p in points}) > 1]
    return [" ".join(p[i] for i in varying if not (skip and p[i].startswith(skip))) or cfg.method.name
            for p, cfg in zip(points, cfgs)]


def _audit(argv: list[str]) -> None:
    """`dpmem audit`: each sweep point trained with canaries into its own folder, and one table of the bounds."""
    from dpmem.audit import check, run_audit, table
    from dpmem.engine.folder import FolderLock, check_owner, mark
    from dpmem.report.labels import file_name

    overrides = _sweep_overrides(argv, "audit")
    if overrides is None:
        return
    records = []
    with _one_line_errors(_is_debug(overrides)), contextlib.ExitStack() as held:
        points = sweep_points(overrides)
        cfgs = compose_points(points)
        labels = _labels(points, cfgs)
        for cfg in cfgs:  # every point's settings before any folder is written
            check(cfg)
        out = _out_dir(overrides, "audit.dir", cfgs[0].audit.dir, "outputs/audit/%Y-%m-%d/%H-%M-%S")
        held.enter_context(FolderLock(out))  # one writer (at the end released, and a folder it made left empty removed)
        key = _dir_key(overrides, "audit.dir")
        check_owner(out, "audit", cfgs[0].train.overwrite, key)
        folders = [out if len(cfgs) == 1 else out / file_name(label) for label in labels]
        for folder, cfg in zip(folders, cfgs):  # each point's folder too, before any is written
            if folder != out:
                check_owner(folder, "audit", cfg.train.overwrite, key)
        mark(out, "audit")
        for label, cfg, folder in zip(labels, cfgs, folders):
            mark(folder, "audit")
            (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            record, _ = run_audit(cfg, folder)
            records.append(record)
            print(f"dpmem audit: {label}: claimed epsilon {record['epsilon_claimed']:.3g}, audited epsilon >= "
                  f"{record['epsilon_lower_bound']:.3f} ({record['correct']}/{record['guesses']} guesses right)",
                  file=sys.stderr)
        text = table(records)
        if len(records) > 1:
            (out / "audit.md").write_text(text)
    print(text, end="")
    print(f"dpmem audit: wrote {out}/audit.md", file=sys.stderr)


def _spectrum(argv: list[str]) -> None:
    """`dpmem spectrum`: one configuration (the C and sigma lists are swept inside), into one folder."""
    from dpmem.engine.folder import LOCK, MARK, FolderLock, check_owner, mark, owner
    from dpmem.spectrum import run_spectrum

    overrides = _sweep_overrides(argv, "spectrum")
    if overrides is None:
        return
    overrides = [("spectrum." + a) if a.startswith("mode=") else a for a in overrides]  # mode= for spectrum.mode=
    with _one_line_errors(_is_debug(overrides)):
        points = sweep_points(overrides)
        if len(points) > 1:
            raise ConfigError("override", "dpmem spectrum takes one configuration (no comma lists); the settings "
                              "it compares are lists: spectrum.clip=[null,1.0] spectrum.sigma=[0,0.5,2.0]")
        (cfg,) = compose_points(points)
        mode = cfg.spectrum.mode.value
        out = _out_dir(overrides, "spectrum.dir", cfg.spectrum.dir, f"outputs/spectrum/%Y-%m-%d/%H-%M-%S_{mode}")
        with FolderLock(out):  # one writer (released, and a folder it made left empty removed, at the end)
            check_owner(out, "spectrum", cfg.train.overwrite, _dir_key(overrides, "spectrum.dir"))
            fresh = owner(out) is None
            mark(out, "spectrum")
            (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            try:
                _, text = run_spectrum(cfg, out)
            except ConfigError:  # refused before it measured: a folder it made holds only its mark and config
                if fresh and {p.name for p in out.iterdir()} <= {MARK, "config.yaml", LOCK}:
                    for name in (MARK, "config.yaml"):
                        (out / name).unlink(missing_ok=True)
                raise
    print(text, end="")
    print(f"dpmem spectrum: wrote {out}/spectrum.json", file=sys.stderr)


def _report(argv: list[str]) -> None:
    """`dpmem report PATH... [--out DIR] [--published] [--select top3]`: tables of every summary.json under the
    paths."""
    from dpmem.report import runs

    if any(a in ("-h", "--help") for a in argv):
        _verb_help("report")
        return
    compare = "--published" in argv
    argv = [a for a in argv if a != "--published"]
    select = None
    if "--select" in argv:
        i = argv.index("--select")
        if i + 1 >= len(argv) or argv[i + 1] != "top3":
            raise _error("--select: allowed top3 (the best metric of the three lowest training losses)")
        select, argv = "top3", argv[:i] + argv[i + 2:]
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        if i + 1 >= len(argv):
            raise _error("--out needs a folder")
        out, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    if not argv:
        raise _error("dpmem report needs the run folders to tabulate: dpmem report PATH... (e.g. dpmem report "
                     "outputs/multirun/DATE)")
    paths = [Path(a) for a in argv]
    try:
        summaries, missing = runs.collect(paths)
    except FileNotFoundError as e:
        raise _error(str(e)) from None
    if not summaries and not missing:
        raise _error(f"no summary.json under {', '.join(map(str, paths))}")
    out = out or paths[0] / "report"
    if out.exists() and not out.is_dir():
        raise _error(f"--out {out} is a file: give the folder the report goes to")
    try:
        print(runs.write(out, summaries, missing, compare, select), end="")
    except OSError as e:  # a read-only run folder (the default output is inside it), a full disk
        raise _error(f"cannot write the report into {out} ({e.strerror or type(e).__name__}): give a folder you can "
                     "write with --out DIR") from None
    print(f"dpmem report: wrote {out}/report.md, report.csv, report.tex", file=sys.stderr)


if __name__ == "__main__":
    main()
