"""Hyperparameter search with Hydra's Optuna sweeper (hydra/sweeper=search): each trial is a normal run folder,
dpmem returns the trial's objective to the sweeper, and a failed trial is recorded as failed without stopping the
search."""

import json
import math

import optuna
import pytest

TINY = ["train.steps=3", "train.batch_size=32", "logging.progress=false", "logging.memory_steps=0"]


@pytest.mark.parametrize("objective", ["metric", "train_loss"])
def test_an_optuna_search_gets_each_trials_objective_and_goes_on_past_a_failed_one(cli, tmp_path, monkeypatch,
                                                                                   objective):
    studies, tell = [], optuna.study.Study.tell

    def told(self, trial, *args, **kwargs):  # what the sweeper tells Optuna of each trial, as Optuna records it
        studies.append(self)
        return tell(self, trial, *args, **kwargs)
    monkeypatch.setattr(optuna.study.Study, "tell", told)
    # a grid of three learning rates, the last so large that the loss turns non-finite: that run fails
    r = cli("train", "-m", "hydra/sweeper=search", "hydra.sweeper.sampler._target_=optuna.samplers.GridSampler",
            "+hydra.sweeper.sampler._partial_=true", "train.lr=choice(0.003, 0.01, 1e30)", "method=dp-adam",
            f"train.objective={objective}", *TINY, "hydra.sweep.dir=search")
    assert r.returncode == 2 and "1 run(s) did not finish ok" in r.stderr, r.stderr  # the search ran to its end
    study = studies[-1]
    trials = study.trials
    assert len(trials) == 3
    for trial in trials:
        (folder,) = (tmp_path / "search").glob(f"{trial.number}_*")
        summary = json.loads((folder / "summary.json").read_text())
        assert float(folder.name.split("train.lr=")[1].split(",")[0]) == trial.params["train.lr"]
        if summary["status"] == "ok":
            want = summary["metric_final"] if objective == "metric" else summary["train_loss"]
            assert trial.state == optuna.trial.TrialState.COMPLETE and trial.value == want
        else:  # the worst value in the search's direction
            assert summary["status"] == "failed" and "NonFiniteLoss" in summary["error"]
            assert trial.params["train.lr"] == 1e30
            assert trial.value == (-math.inf if objective == "metric" else math.inf)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert study.direction.name == ("MAXIMIZE" if objective == "metric" else "MINIMIZE")


def test_an_interval_is_left_to_the_sweeper_and_a_value_refused_in_a_trial_fails_that_trial_alone(cli, tmp_path):
    """The preflight checks what it can enumerate; an interval's draws, and what only the built model can refuse
    (method.rank beyond every layer), are checked by each trial: one line, and the search goes on."""
    r = cli("train", "-m", "hydra/sweeper=search", "hydra.sweeper.n_trials=1", "train.lr=tag(log, interval(1e-3, 1e-2))",
            *TINY, "hydra.sweep.dir=drawn")
    assert r.returncode == 0, r.stderr
    (summary,) = [json.loads(p.read_text()) for p in (tmp_path / "drawn").glob("*/summary.json")]
    assert 1e-3 <= summary["lr"] <= 1e-2 and summary["status"] == "ok"
    r = cli("train", "-m", "hydra/sweeper=search", "hydra.sweeper.sampler._target_=optuna.samplers.GridSampler",
            "+hydra.sweeper.sampler._partial_=true", "method=grape", "method.rank=choice(4, 1000)", *TINY,
            "hydra.sweep.dir=refused")
    assert r.returncode == 2 and "1 run(s) did not finish ok" in r.stderr, r.stderr
    assert r.stderr.count("method.rank: 1000 is at least") == 1
    assert len(list((tmp_path / "refused").glob("*/summary.json"))) == 1  # the good trial ran
