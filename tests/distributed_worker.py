"""Runs dpmem `Run`s in one process or, under torchrun, in each rank (tests/test_distributed.py launches it both
ways and compares). Usage: python distributed_worker.py OUT_DIR JOBS.json, where JOBS.json is a list of
{"name": ..., "overrides": [...], "die_at_step": k, "resume": bool} (the last two optional). For each job, rank 0
saves the initial and final parameters to OUT_DIR/NAME.init.pt and NAME.pt; the run folder is OUT_DIR/NAME/. `die_at_step` makes every rank's
method raise at that step (a crash after a checkpoint); unless "resume" is false the job is then run again in the
same folder, which resumes it."""

import json
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from dpmem import distributed
from dpmem.cli import CONF_DIR
from dpmem.engine.trainer import Run


class Died(Exception):
    pass


def parameters(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def run(cfg, folder: Path, die_at_step: int | None = None) -> Run:
    if distributed.is_main():
        folder.mkdir(parents=True, exist_ok=True)
    run = Run(cfg, folder)
    run.prepare()
    if distributed.is_main():
        torch.save(parameters(run.model), folder.parent / f"{folder.name}.init.pt")
    if die_at_step is not None:
        real, calls = run.method.step, []

        def dies(micro, loss_fn):
            calls.append(1)
            if len(calls) == die_at_step:
                raise Died("the machine went away")
            return real(micro, loss_fn)
        run.method.step = dies
    run.execute()
    return run


def main(out: Path, jobs: list[dict]) -> None:
    distributed.init_from_env()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfgs = [compose("config", overrides=job["overrides"]) for job in jobs]
    for job, cfg in zip(jobs, cfgs):
        folder = out / job["name"]
        done = run(cfg, folder, job.get("die_at_step"))
        if job.get("die_at_step") is not None and job.get("resume", True):
            done = run(cfg, folder)
        if distributed.is_main():
            torch.save(parameters(done.model), out / f"{job['name']}.pt")
    distributed.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
