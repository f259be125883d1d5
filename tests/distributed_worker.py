"""Runs dpmem `Run`s in one process or, under torchrun, in each rank (tests/test_distributed.py launches it both
ways and compares). Usage: python distributed_worker.py OUT_DIR JOBS.json, where JOBS.json is a list of
{"name": ..., "overrides": [...], "die_at_step": k, "resume": bool, "force_compile": bool} (the last three
optional; force_compile compiles the private step past train.compile's refusal and writes what stopped it, if
anything, to OUT_DIR/NAME.compile.txt, the run going on eagerly). For each job, rank 0
saves the initial and final parameters to OUT_DIR/NAME.init.pt and NAME.pt (and, with train.fsdp=true, what FSDP
did per step to NAME.fsdp.json); the run folder is OUT_DIR/NAME/. `die_at_step` makes every rank's
method raise at that step (a crash after a checkpoint); unless "resume" is false the job is then run again in the
same folder, which resumes it. Where OUT_DIR/configs.pkl is (the test composes every job's config once, for both
launches), the jobs' configs are read from it in the order of JOBS.json instead of composed in each process."""

import json
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch.distributed.fsdp import FSDPModule

from dpmem import distributed, sharding
from dpmem.compiling import Compiler
from dpmem.composition import CONF_DIR
from dpmem.data.bundle import real_size
from dpmem.engine.folder import claim
from dpmem.engine.trainer import Run


class Died(Exception):
    pass


def parameters(model) -> dict:
    """Whole parameters (FSDP's shards gathered: every rank takes part)."""
    return {n: sharding.full(p.detach()).cpu().clone() for n, p in model.named_parameters()}


def run(cfg, folder: Path, die_at_step: int | None = None, force_compile: bool = False) -> Run:
    if distributed.is_main():
        folder.mkdir(parents=True, exist_ok=True)
    run = Run(cfg, folder, checkpoint=claim(cfg, folder))
    run.prepare()
    if force_compile:
        forced(run, folder)
    initial = parameters(run.model)
    if distributed.is_main():
        torch.save(initial, folder.parent / f"{folder.name}.init.pt")
    if die_at_step is not None:
        real, calls = run.method.step, []

        def dies(micro, loss_fn):
            calls.append(1)
            if len(calls) == die_at_step:
                raise Died("the machine went away")
            return real(micro, loss_fn)
        run.method.step = dies
    log = FSDPWatch(run) if cfg.train.fsdp else None
    try:
        run.execute()
    finally:
        if log is not None:
            log.close()
    return run


def forced(run: Run, folder: Path) -> None:
    """The private step's micro-batch compiled (aot_eager) past the refusal, for the method's first step:
    what dynamo raised (every rank traces the same graph, so every rank raises alike), or "compiled", is written
    down, and the step goes back to eager."""
    privatizer, real = run.method.privatizer, run.method.step
    step_state = privatizer.compiled
    step_state.microbatch = Compiler(torch.device("cpu"), "aot_eager")(privatizer._microbatch_flat, "microbatch")
    step_state.copy_first, calls = False, []

    def step(micro, loss_fn):
        calls.append(1)
        if len(calls) != 1:  # the first step compiles (after its eager rehearsal: Privatizer._rehearse)
            return real(micro, loss_fn)
        try:
            out, said = real(micro, loss_fn), "compiled"
        except Exception as e:  # noqa: BLE001  (whatever stopped it is the finding)
            step_state.microbatch, step_state.flat = None, None
            e = e.__cause__ or e  # dynamo's own error under train.compile's one-line refusal
            out, said = real(micro, loss_fn), f"{type(e).__name__}: {e}"
        if distributed.is_main():
            (folder.parent / f"{folder.name}.compile.txt").write_text(said)
        step_state.microbatch = None
        return out
    run.method.step = step


class FSDPWatch:
    """Per step of an FSDP run, on every rank: its micro-batches, how many were padding, and how many reduce-scatters
    FSDP made (gathered to rank 0 as `steps`, one list per rank)."""

    def __init__(self, run: Run):
        self.calls, self.log, self.run = 0, [], run
        # what FSDP2 reduce-scatters with: reduce_scatter_single from torch 2.14, reduce_scatter_tensor before
        self.name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        self.reduce_scatter = getattr(dist, self.name)
        self.units = sum(isinstance(m, FSDPModule) for m in run.parts.root.modules())

        def counting(*args, **kwargs):
            self.calls += 1
            return self.reduce_scatter(*args, **kwargs)
        setattr(dist, self.name, counting)
        real = run.method.step

        def step(micro, loss_fn):
            self.calls = 0
            out = real(micro, loss_fn)
            self.log.append({"micro": len(micro), "padding": sum(real_size(m) == 0 for m in micro),
                             "reduce_scatters": self.calls})
            return out
        run.method.step = step

    def close(self) -> None:
        setattr(dist, self.name, self.reduce_scatter)
        steps = distributed.gathered(self.log)
        if distributed.is_main():
            record = {"units": self.units, "steps": steps}
            (self.run.run_dir.parent / f"{self.run.run_dir.name}.fsdp.json").write_text(json.dumps(record))


def main(out: Path, jobs: list[dict]) -> None:
    distributed.init_from_env()
    composed = out / "configs.pkl"
    if composed.exists():
        cfgs = pickle.loads(composed.read_bytes())
    else:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfgs = [compose("config", overrides=job["overrides"]) for job in jobs]
    for job, cfg in zip(jobs, cfgs):
        folder = out / job["name"]
        done = run(cfg, folder, job.get("die_at_step"), job.get("force_compile", False))
        if job.get("die_at_step") is not None and job.get("resume", True):
            done = run(cfg, folder)
        final = parameters(done.model)
        if distributed.is_main():
            torch.save(final, out / f"{job['name']}.pt")
    distributed.settle()
    # every result is saved: leave without tearing the process group down. Under load, gloo's teardown at exit
    # sometimes aborted a rank ("terminate called without an active exception") after all of this was written
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
