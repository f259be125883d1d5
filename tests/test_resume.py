"""Fault tolerance: a run that dies resumes from its last checkpoint to the very parameters and ε of a run that
never died (the oracle), for every method; a finished run is skipped by a re-launched sweep."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from dpmem.cli import CONF_DIR
from dpmem.engine.trainer import Run, run_training
from dpmem.methods import METHODS

SMALL = ["model.arch.hidden_size=16", "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2",
         "model.arch.intermediate_size=32", "model.arch.patch_size=4"]
# ε = 0.1: a large σ, which the accountants calibrate and account in a fraction of the time they take at ε = 8
# (what is tested is that ε after resuming is the uninterrupted run's, not its size)
PRIVACY = ["privacy.epsilon=0.1", "privacy.noise_seed=3"]
PROJECTED = ("grape", "galore-dp-naive")  # the methods with a rank and a refresh interval (refreshed mid-run here)


def config(method, *overrides):
    own = ["method.refresh=2", "method.rank=4"] if method in PROJECTED else []
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=[f"method={method}", "train.steps=6", "train.batch_size=32",
                                            "logging.progress=false", "logging.every=1", "logging.memory_steps=0",
                                            *PRIVACY, *own, *SMALL, *overrides])


@pytest.mark.parametrize("method", ["adam", "dp-adam", "grape", "galore-dp-naive", "dpzero", "dp-sgd-rc"])
def test_a_run_that_dies_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, method):
    captured = {}
    real_execute = Run.execute

    def keep_model(self):
        captured[self.run_dir.name] = self
        return real_execute(self)
    monkeypatch.setattr("dpmem.engine.trainer.Run.execute", keep_model)
    lr = ["train.lr=1e-4"] if method == "dpzero" else []
    oracle = run_training(config(method, *lr), tmp_path / "oracle")

    cls, calls = METHODS[method], []
    real_step = cls.step

    def dies_at_step_5(self, micro, loss_fn):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("the machine went away")
        return real_step(self, micro, loss_fn)
    monkeypatch.setattr(cls, "step", dies_at_step_5)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config(method, "train.checkpoint_every=2", *lr), tmp_path / "resumed")
    dead = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert dead["status"] == "failed" and dead["steps_done"] == 4
    assert (tmp_path / "resumed" / "checkpoint.pt").exists()

    after = []

    def counted(self, micro, loss_fn):
        after.append(1)
        return real_step(self, micro, loss_fn)
    monkeypatch.setattr(cls, "step", counted)
    resumed = run_training(config(method, "train.checkpoint_every=2", *lr), tmp_path / "resumed")
    assert len(after) == 2  # steps 5 and 6 only: the other four came from the checkpoint
    assert resumed["status"] == "ok" and resumed["resumed_from_step"] == 4 and resumed["steps_done"] == 6
    assert resumed["epsilon_spent"] == oracle["epsilon_spent"]
    for (name, a), b in zip(captured["oracle"].model.named_parameters(), captured["resumed"].model.parameters()):
        assert torch.equal(a, b), name
    lines = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6, 6]  # the lost step 5 is not recorded twice
    assert not (tmp_path / "resumed" / "checkpoint.pt").exists()  # finished: nothing to resume


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path, monkeypatch):
    calls = []
    real_step = METHODS["dp-adam"].step

    def dies(self, micro, loss_fn):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("gone")
        return real_step(self, micro, loss_fn)
    monkeypatch.setattr(METHODS["dp-adam"], "step", dies)
    with pytest.raises(RuntimeError, match="gone"):
        run_training(config("dp-adam", "train.checkpoint_every=2"), tmp_path)
    monkeypatch.setattr(METHODS["dp-adam"], "step", real_step)
    with pytest.raises(RuntimeError, match="another configuration"):
        run_training(config("dp-adam", "train.checkpoint_every=2", "train.lr=0.5"), tmp_path)


def test_a_relaunched_sweep_skips_runs_that_finished(cli, tmp_path):
    args = ["train", "-m", "method=adam,dp-adam", *PRIVACY, "train.steps=2", "train.batch_size=32",
            "logging.progress=false", "logging.memory_steps=0", "train.skip_done=true",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    done = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(done) == 2
    stamps = [f.stat().st_mtime_ns for f in done]
    # one of them is marked unfinished: the re-launch runs it again and skips the other
    s = json.loads(done[1].read_text())
    s["status"] = "interrupted"
    done[1].write_text(json.dumps(s))
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert done[0].stat().st_mtime_ns == stamps[0]
    assert json.loads(done[1].read_text())["status"] == "ok"
    assert again.stderr.count("skipped (train.skip_done)") == 1
