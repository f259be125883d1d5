"""Config composition, as every verb, the Python API, the scripts and the tests do it: the config groups under
dpmem/conf, the schemas that validate them (`dpmem.config`), the resolvers their files use, and each sweep point
composed and validated once, so that a bad value ends in one ConfigError that names the key and what is allowed."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import sys
from datetime import datetime
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from dpmem import distributed
from dpmem.config import ConfigError, enum_value, no_such_key, register_configs
from dpmem.engine.placement import cuda_device_count

CONF_DIR = str(Path(__file__).resolve().parent / "conf")  # inside the package: works from any install
MAX_PREFLIGHT = 256  # sweep points composed before launch; larger grids are checked per job

register_configs()
_launched_at: str | None = None


def _remember_config_files() -> None:
    """Hydra reads and parses each config file anew for every composition (its own cache lives for one compose),
    and a sweep's preflight, its jobs and each tool's points compose the same few dozen YAML files: parsing them
    was a third of a composition. Each file's load (its config and defaults list) is kept for the process, keyed by
    its source and name, and for a file on disk by its text too (an edited file is parsed again); Hydra is handed a
    copy, so that nothing it does with a load reaches the kept one. File and package sources only: a structured
    config can be stored again under its name."""
    from hydra._internal.config_repository import ConfigRepository, ObjectType

    load, kept = ConfigRepository.load_config, {}

    def load_config(self, config_path: str):
        # by scheme, not class: Hydra's plugin discovery imports its sources' modules a second time
        source = self._find_object_source(config_path=config_path, object_type=ObjectType.CONFIG)
        if source is None or source.scheme() not in ("file", "pkg"):
            return load(self, config_path)
        key = (source.path, config_path)
        if source.scheme() == "file":  # its text, not its time stamp (coarser than two quick edits)
            try:
                key += (Path(source.path, source._normalize_file_name(config_path)).read_bytes(),)
            except OSError:  # gone since Hydra looked: its own error
                return load(self, config_path)
        if key not in kept:
            kept[key] = load(self, config_path)
        return copy.deepcopy(kept[key])

    ConfigRepository.load_config = load_config


_remember_config_files()


def _launch_time(pattern: str) -> str:
    """`${launch_time:%H-%M-%S}` in run folder names: the time `dpmem train` started, on rank 0 (torchrun's ranks
    start at slightly different times, and must name one folder)."""
    global _launched_at
    if _launched_at is None:
        _launched_at = distributed.from_main(datetime.now().isoformat())
    return datetime.fromisoformat(_launched_at).strftime(pattern)


def direction(objective_name: str) -> str:
    """hydra/sweeper=search's direction for train.objective (a loss metric, as data=median's, needs
    hydra.sweeper.direction=minimize)."""
    return "minimize" if enum_value(objective_name) == "train_loss" else "maximize"


def unless_sigma(epsilon, *, _parent_):
    """The default privacy group's budget (`privacy=default`): ε, unless privacy.noise_multiplier fixes σ. A budget
    given by name (privacy=eps2, privacy.epsilon=2) stays beside a fixed σ, and is refused there."""
    return None if _parent_.get("noise_multiplier") is not None else epsilon


OmegaConf.register_new_resolver("launch_time", _launch_time, use_cache=True, replace=True)
OmegaConf.register_new_resolver("dpmem.cuda_device_count", cuda_device_count, replace=True)  # hydra/launcher=local
OmegaConf.register_new_resolver("dpmem.direction", direction, replace=True)
OmegaConf.register_new_resolver("dpmem.unless_sigma", unless_sigma, replace=True)


def error(message: str) -> SystemExit:
    """A command's end in one line on stderr (exit 2), to raise."""
    print(f"dpmem: error: {message}", file=sys.stderr)
    return SystemExit(2)


def groups() -> dict[str, list[str]]:
    conf = Path(CONF_DIR)
    # options in sub-folders are named by their path: experiment=spectrum/layer-vit-digits; conf/hydra holds
    # Hydra's own groups (hydra/launcher=slurm), which Hydra checks
    return {d.name: sorted(f.relative_to(d).with_suffix("").as_posix() for f in d.rglob("*.yaml"))
            for d in conf.iterdir() if d.is_dir() and d.name != "hydra"}


def group_options() -> dict[str, list[str]]:
    """Each config group's options by folder (`experiment/spectrum: layer-vit-digits, ...`): `dpmem train --help`."""
    by_folder: dict[str, list[str]] = {}
    for group, options in sorted(groups().items()):
        for option in options:
            folder, _, name = option.rpartition("/")
            by_folder.setdefault(f"{group}/{folder}" if folder else group, []).append(name)
    return by_folder


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """Every point of the sweep the overrides describe (`a=1,2 b=3,4`: four points), group options checked.
    Raises ConfigError."""
    plain = [o for o in overrides if not o.lstrip("+~").startswith(("-", "hydra.", "hydra/"))]
    try:
        parsed = OverridesParser.create().parse_overrides(plain)
    except Exception as e:  # hydra's OverrideParseException and friends
        raise ConfigError("override", str(e).splitlines()[0] + quoting(plain)) from None
    options = groups()
    choices = []
    for o in parsed:
        if o.is_interval_sweep():  # interval(a, b): a sweeper (optuna) draws the value; each trial checks its own
            continue
        key = o.key_or_group.lstrip("+~")
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        if key in options:
            for v in values:
                if v not in options[key]:
                    raise ConfigError(key, f"unknown option {v!r}; allowed: {', '.join(options[key])}")
        prefix = o.input_line.split("=", 1)[0]
        choices.append([f"{prefix}={v}" for v in values])
    return [list(point) for point in itertools.product(*choices)]


def quoting(overrides: list[str]) -> str:
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
        cfg = compose("config", overrides=point, return_hydra_config=True)
    except Exception as e:  # hydra wraps OmegaConf's validation error (once or twice), which names the key
        cause = e
        while cause is not None and not (isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", 0)):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:  # a key set in a config file: say which file ("In 'hp/table7/dp-adam-mnist'")
            where = first_line(e).split(":")[0] + ": " if first_line(e).startswith("In '") else ""
            raise ConfigError(cause.full_key, where + key_message(cause)) from None
        raise ConfigError("override", first_line(e)) from None
    preset = cfg.hydra.runtime.choices.get("privacy")
    with open_dict(cfg):  # what compose gives without return_hydra_config
        del cfg["hydra"]
    sigma = cfg.privacy.get("noise_multiplier")
    if preset == "none" and sigma is not None:  # it would train privately under a preset that says non-private
        raise ConfigError("privacy.noise_multiplier", f"{sigma:g} fixes σ of a private run, and privacy=none is "
                          "the non-private preset: give one (privacy.noise_multiplier alone for a fixed σ)")
    from dpmem.methods import validate  # lazily, as each verb's modules (the methods pull in transformers)

    validate(cfg)
    return cfg


def compose_points(points: list[list[str]]) -> list[DictConfig]:
    """The validated config of each sweep point, outside any Hydra app. Raises ConfigError."""
    with initialized():
        return [compose_point(point) for point in points]


@contextlib.contextmanager
def initialized():
    """Hydra initialised on dpmem's config groups within, outside any Hydra app (and cleared before and after)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            yield
    finally:
        GlobalHydra.instance().clear()


ABSENT = object()


def select(cfg: DictConfig, key: str):
    """The node at `key` (a value, or a section), or ABSENT where there is none."""
    try:
        return OmegaConf.select(cfg, key, default=ABSENT, throw_on_missing=False)
    except OmegaConfBaseException:  # e.g. a list indexed by a name
        return ABSENT


def first_line(e: Exception) -> str:
    msg = getattr(e, "msg", None) or str(e)
    return msg.strip().splitlines()[0].strip()


def key_message(e: OmegaConfBaseException) -> str:
    """OmegaConf's message; for an unknown key, the keys its section allows (a method's own, for method.KEY)."""
    schema = getattr(e, "object_type", None)
    if not (isinstance(e, (ConfigAttributeError, ConfigKeyError)) and isinstance(schema, type)
            and dataclasses.is_dataclass(schema)):
        return first_line(e)
    return no_such_key(schema, getattr(e, "parent_node", None), e.key, first_line(e))


def labels(points: list[tuple[str, ...]], cfgs, skip: str | None = None) -> list[str]:
    """Each sweep point named by the overrides that vary across the sweep (the method's name when none do)."""
    varying = [i for i in range(len(points[0])) if len({p[i] for p in points}) > 1]
    return [" ".join(p[i] for i in varying if not (skip and p[i].startswith(skip))) or cfg.method.name
            for p, cfg in zip(points, cfgs)]
