"""Sweeps through Hydra's launcher plugins (the cluster extra): joblib runs jobs side by side in worker processes,
hydra/launcher=local runs each as a submitit job (what hydra/launcher=slurm submits), both into the usual sweep
folder, which dpmem report reads as any other; a failed job makes the sweep exit non-zero; a relaunch with
train.skip_done skips the finished runs; and the GPU each concurrent job takes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from dpmem.composition import CONF_DIR, groups, sweep_points
from dpmem.engine import placement
from dpmem.engine.placement import job_gpu
from dpmem.report import runs

JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
LOCAL = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
# two tiny runs: a job's cost is mostly its process's imports
SWEEP = ["method=adam,dp-adam", "train.steps=2", "train.batch_size=32", "train.eval_batch_size=512",
         "logging.progress=false", "logging.memory_steps=0"]


def finished(sweep: Path, launcher: str) -> list[Path]:
    """The sweep's two summaries, both ok, written by jobs that `launcher` ran."""
    done = sorted(sweep.glob("*/summary.json"))
    assert len(done) == 2, sorted(p.name for p in sweep.iterdir())
    assert [json.loads(f.read_text())["status"] for f in done] == ["ok", "ok"]
    for f in done:
        assert OmegaConf.load(f.parent / ".hydra" / "hydra.yaml").hydra.launcher._target_ == launcher
    return done


def assert_reported(cli, sweep: Path) -> None:
    """dpmem report over the sweep folder: both runs in the table, nothing taken for a run that died."""
    summaries, missing = runs.collect([sweep])
    assert len(summaries) == 2 and missing == []
    r = cli("report", str(sweep))
    assert r.returncode == 0, r.stderr
    table = [line for line in r.stdout.splitlines() if line.startswith("| adam") or line.startswith("| dp-adam")]
    assert len(table) == 2 and "Not in the table" not in r.stdout, r.stdout


@pytest.mark.long
def test_a_joblib_sweep_runs_side_by_side_fails_for_a_failed_run_and_a_relaunch_redoes_only_that(cli, tmp_path):
    sweep = tmp_path / "sweep"
    args = ["train", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *SWEEP, f"hydra.sweep.dir={sweep}",
            "hydra.sweep.subdir=${hydra.job.num}"]
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "checkpoint.pt").write_bytes(b"not a checkpoint")  # run 0 cannot resume: its job fails
    first = cli(*args)
    assert first.returncode != 0 and "not a readable checkpoint" in first.stderr, first.stderr[-2000:]
    statuses = {f.parent.name: json.loads(f.read_text())["status"] for f in sweep.glob("*/summary.json")}
    assert statuses == {"1": "ok"}  # the other job ran to its end beside it; the refused one wrote nothing
    ok = (sweep / "1" / "summary.json").stat().st_mtime_ns, (sweep / "1" / "summary.json").read_text()
    # the same sweep again with train.skip_done (not part of the run folders' names): the finished run is found and
    # skipped, its records untouched; the failed one runs again
    (sweep / "0" / "checkpoint.pt").unlink()
    again = cli(*args, "train.skip_done=true")
    assert again.returncode == 0, again.stderr
    finished(sweep, JOBLIB)
    assert ((sweep / "1" / "summary.json").stat().st_mtime_ns, (sweep / "1" / "summary.json").read_text()) == ok
    assert_reported(cli, sweep)


@pytest.mark.long
def test_a_submitit_local_sweep_writes_its_runs_and_logs_into_the_sweep_folder(cli, tmp_path):
    sweep = tmp_path / "sweep"
    # in a process of its own: run in-process after other tests of the same pytest worker, it failed in pytest's
    # output capture ("I/O operation on closed file")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    r = subprocess.run([sys.executable, "-m", "dpmem.cli", "train", "-m", "hydra/launcher=local", *SWEEP,
                        f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    finished(sweep, LOCAL)
    logs = sorted((sweep / ".submitit").glob("*/*_0_log.out"))
    assert len(logs) == 2 and all("Job completed successfully" in f.read_text() for f in logs)
    assert_reported(cli, sweep)  # .submitit/ holds no summary and no config.yaml: report passes it by


def test_launcher_options_compose_with_dpmems_settings_and_are_not_dpmemgroups():
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            slurm = compose("config", ["hydra/launcher=slurm"], return_hydra_config=True).hydra.launcher
            local = compose("config", ["hydra/launcher=local"], return_hydra_config=True).hydra.launcher
    finally:
        GlobalHydra.instance().clear()
    assert slurm._target_ == SLURM and local._target_ == LOCAL
    assert slurm.partition is None and (slurm.gpus_per_task, slurm.tasks_per_node) == (1, 1)
    assert slurm.timeout_min == 1440 and slurm.cpus_per_task > 0 and slurm.mem_gb > 0
    assert local.gpus_per_node == torch.cuda.device_count()  # every GPU, so that each job can pick its own
    assert "hydra" not in groups()
    assert len(sweep_points(["-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "method=adam,grape"])) == 2


def test_job_gpu_spreads_concurrent_jobs_over_the_gpus_and_leaves_others_alone():
    assert [job_gpu(JOBLIB, n, 4) for n in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [job_gpu(LOCAL, n, 2) for n in range(3)] == [0, 1, 0]
    for target in (SLURM, BASIC):  # a SLURM job has its own GPU; the basic launcher runs one job at a time
        assert job_gpu(target, 3, 4) is None
    assert job_gpu(JOBLIB, 3, 1) is None and job_gpu(JOBLIB, 3, 0) is None  # restricted to one GPU, or none


@pytest.mark.parametrize("device,want", [("auto", [1]), ("cuda", [1]), ("cpu", [])])
def test_place_job_sets_the_current_gpu_of_a_gpu_run(monkeypatch, device, want):
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    placement.place_job(JOBLIB, 5, device)
    assert chosen == want
