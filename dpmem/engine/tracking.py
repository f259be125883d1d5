"""Weights & Biases, optional: `logging.wandb.enabled=true` mirrors the run's config, every metrics.jsonl record
and the final summary. A tracker that cannot start (no package, no network, no login) warns once and the run
goes on: the run folder stays the record."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from dpmem.config import enum_value


class NoTracker:
    def log(self, record: dict) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass


class WandbTracker:
    def __init__(self, run):
        self.run = run

    def log(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def finish(self, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish(exit_code=0 if summary.get("status") == "ok" else 1)


def open_tracker(cfg, run_dir: Path):
    w = cfg.logging.wandb
    if not w.enabled:
        return NoTracker()
    try:
        import wandb
        run = wandb.init(project=w.project, entity=w.entity, group=w.group, tags=list(w.tags),
                         name=Path(run_dir).name, dir=str(run_dir), mode=enum_value(w.mode),
                         config=OmegaConf.to_container(cfg, resolve=True))
    except Exception as e:  # ImportError, a login or network failure: the run itself must not depend on it
        print(f"dpmem: wandb not started ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
              "the run folder keeps every record", file=sys.stderr)
        return NoTracker()
    return WandbTracker(run)
