"""logging.wandb: what reaches wandb is what the run folder records; offline mode writes a run with no network; a
tracker that cannot start never stops the run."""

import glob
import json
import time

import wandb
from hydra import compose, initialize_config_dir

from dpmem.composition import CONF_DIR
from dpmem.engine.trainer import run_training


def config(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=["train.steps=3", "train.batch_size=32", "logging.progress=false",
                                            "logging.every=1", "logging.memory_steps=0", "method=dp-adam", *overrides])


class FakeRun:
    def __init__(self, calls):
        self.calls, self.summary = calls, {}

    def log(self, data, step):
        self.calls["log"].append((step, data))

    def finish(self, exit_code):
        self.calls["finish"] = exit_code


def fake_init(calls, fail=False):
    """wandb.init replaced by a recorder (the real package stays imported: transformers looks it up)."""
    def init(**kwargs):
        if fail:
            raise RuntimeError("api key not configured (no-tty)")
        calls["init"] = kwargs
        calls["run"] = FakeRun(calls)
        return calls["run"]
    return init


def test_config_metrics_and_summary_reach_wandb_as_the_run_folder_records_them(tmp_path, monkeypatch):
    calls = {"log": []}
    monkeypatch.setattr(wandb, "init", fake_init(calls))
    summary = run_training(config("logging.wandb.enabled=true", "logging.wandb.group=g1", "logging.wandb.mode=offline",
                                  "logging.wandb.tags=[a,b]"), tmp_path)
    init = calls["init"]
    assert (init["project"], init["group"], init["mode"], init["tags"]) == ("dpmem", "g1", "offline", ["a", "b"])
    assert init["config"]["method"]["name"] == "dp-adam" and init["dir"] == str(tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], {k: v for k, v in r.items() if k != "step"}) for r in lines] == calls["log"]
    assert len(calls["log"]) == 4 and "accuracy" in calls["log"][-1][1]
    assert calls["run"].summary["status"] == "ok" == summary["status"] and calls["finish"] == 0
    assert calls["run"].summary["epsilon_spent"] == summary["epsilon_spent"]


def test_a_tracker_that_cannot_start_does_not_stop_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wandb, "init", fake_init({}, fail=True))
    summary = run_training(config("logging.wandb.enabled=true"), tmp_path)
    assert summary["status"] == "ok" and "wandb not started" in capsys.readouterr().err


def test_offline_mode_writes_a_wandb_run_without_a_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the suite disables wandb; this test wants the real one
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_training(config("logging.wandb.enabled=true", "logging.wandb.mode=offline"), tmp_path)
    (log,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's service process writes the file after run.finish() returns: under load (CI, 2 cores) it has been
    # read with only its header, so it is read until it holds the run (or a minute has passed)
    deadline, want = time.time() + 60, (b"metric_final", b"epsilon_spent", b"loss", b"dp-adam")
    while not all(w in open(log, "rb").read() for w in want) and time.time() < deadline:
        time.sleep(0.5)
    data = open(log, "rb").read()
    assert all(w in data for w in want), data[:200]
