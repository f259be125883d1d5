"""The Hydra side of a private search: draw K and the trials (dpmem.engine.selection), launch them with the
configured launcher, score them, and write what is released. Nothing it or the launcher prints while the trials run
reaches the console (it would count them): that goes to the sweep folder's trials.log, the holder's."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus, configure_log
from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf


class PrivateSweeper(Sweeper):
    def __init__(self, mean_trials: float, shape: Any, params: Any = None):
        self.mean_trials, self.shape = mean_trials, shape
        self.params = OmegaConf.to_container(params, resolve=False) if params is not None else None
        self.config = self.launcher = self.hydra_context = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from dpmem.composition import error
        from dpmem.config import ConfigError
        from dpmem.engine import job
        from dpmem.engine.folder import FolderLock
        from dpmem.engine.selection import (RELEASED, SELECTION, TRIALS_LOG, SearchState, finish, parse_space,
                                            plan_search, trial_overrides)

        folder = Path(self.config.hydra.sweep.dir).absolute()
        try:
            fixed, dims = parse_space(arguments, self.params)
            search = plan_search(self.config, self.mean_trials, self.shape, arguments)
            with FolderLock(folder, "hydra.sweep.dir"):  # one search writes a sweep folder at a time
                state = SearchState(folder, search, fixed, dims)
                names = [state.name(i) for i in range(state.trials)]
                points = [state.point(i, dims) for i in range(state.trials)]
                returns = []
                if names:
                    batch = [trial_overrides(search, fixed, p, n) for p, n in zip(points, names)]
                    self.validate_batch_is_legal(batch)
                    with _to_log(folder / TRIALS_LOG, self.config):
                        returns = self.launcher.launch(batch, initial_job_idx=0)
                    job.failed.clear()  # how many trials failed, and which, is the holder's (search.json)
                results = [(folder / n, r.return_value if r.status == JobStatus.COMPLETED else None)
                           for n, r in zip(names, returns)]
                record = finish(folder, search, state, results, points)
        except ConfigError as e:
            raise error(str(e)) from None
        except (KeyboardInterrupt, SystemExit) as e:
            if isinstance(e, SystemExit) and e.code in (0, None):
                raise
            print(f"dpmem: the private search in {folder} was interrupted: the same command resumes it (the same K "
                  "and trials; finished trials are skipped)", file=sys.stderr)
            raise SystemExit(130) from None
        released = f"{folder / RELEASED}/" if record["ended"] == "completed" else "nothing"
        per = " per user" if record["unit"] == "user" else ""
        print(f"dpmem: private search ended ({record['ended']}): release {released} at ε = {record['epsilon']:g}"
              f"{per}, δ = {record['delta']:.3g} (what it holds: {folder / RELEASED / SELECTION})", file=sys.stderr)
        return []


@contextlib.contextmanager
def _to_log(path: Path, config):
    """What this process and its children print meanwhile, to `path` (descriptors 1 and 2, and Python's streams);
    Hydra's logging set up again afterwards (the launcher set it up on the streams it found)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a") as log:
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield
        finally:
            log.flush()
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
            configure_log(config.hydra.hydra_logging, config.hydra.verbose)
