"""One job of `dpmem train` under Hydra, whatever launches it (`run_job`)."""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from dpmem.composition import error
from dpmem.config import ConfigError, enum_value
from dpmem.engine.placement import place_job
from dpmem.engine.search import objective

failed: list[str] = []  # runs of this process's sweep that did not end ok
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


class RunFailed(RuntimeError):
    """A run under a launcher ended without an exception but not ok (out of memory): its job fails."""


def run_job(cfg: DictConfig) -> float:
    """A run, or a sweep's point: trained, or skipped when done; its objective returned to the sweeper. A failure
    ends a single run with one line (exit 2 for bad input); a sweep goes on past it, and says at the end how many
    runs did not finish ok (`failed`)."""
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
    summary = None  # (a failure a sweep goes on past leaves it so: the run is counted failed, its objective worst)
    try:
        # done with this configuration (another one's finished run is refused); unreadable: not done
        if cfg.train.skip_done and (done := skip_done(cfg, run_dir)) is not None:
            print(f"dpmem: {run_dir} is done (status ok, the same configuration), skipped (train.skip_done)",
                  file=sys.stderr)
            return objective(cfg, done)
        if multirun:  # a launcher that runs jobs side by side on one machine: one GPU each, not all on GPU 0
            place_job(hc.launcher._target_, hc.job.num, enum_value(cfg.train.device))
        validate(cfg)
        summary = run_training(cfg, run_dir)
    except ConfigError as e:  # this run only (a refused folder, a value a sweeper drew): a sweep goes on
        drop_if_empty(run_dir)  # found after Hydra made the folder: no empty folder is left behind
        if cfg.debug:
            raise
        if not multirun:
            raise error(str(e)) from None
        what = "refused" if isinstance(e, FolderRefused) else "failed"
        if not here:
            raise RunFailed(f"run {run_dir} {what}: {e}") from None
        print(f"dpmem: run {run_dir} {what}: {e}", file=sys.stderr)
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
    if summary is None or summary["status"] != "ok":
        if not here:  # (a run that raised has `here`: it was raised above otherwise)
            raise RunFailed(f"run {run_dir} ended with status {summary['status']}: {summary['error']}")
        failed.append(str(run_dir))
    return objective(cfg, summary)
