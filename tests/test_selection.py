"""Private hyperparameter selection (hydra/sweeper=private; dpmem.privacy.selection, dpmem.engine.selection): the
law of the number of trials K, the selection's ε against dp-accounting's event built here and against Papernot &
Steinke's closed form, the calibration, a search end to end, its refusals, and a resume after SIGKILL."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting import dp_event, rdp
from scipy import stats

from dpmem.engine import selection as search
from dpmem.privacy.randomness import derive, seed_key
from dpmem.privacy.selection import (POISSON, calibrate_selection, draw_trials, gamma, pmf, selection_epsilon)

Q, STEPS, DELTA = 256 / 1797, 100, 1e-5  # the default digits task at 100 steps
TINY = ["model=vit-tiny", "data.image_size=8", "train.steps=2", "train.batch_size=64", "logging.progress=false",
        "logging.memory_steps=0"]


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0, POISSON])
def test_the_number_of_trials_follows_its_law(shape):
    """4,000 draws of K (mean 4) from distinct keys against the pmf, by a χ² test over k (the tail pooled); the pmf
    itself sums to 1 and has mean 4."""
    mean = 4.0
    ks = np.array([draw_trials(mean, shape, seed_key(i)) for i in range(4000)])
    support = range(0 if shape == POISSON else 1, 400)
    assert sum(pmf(k, mean, shape) for k in support) == pytest.approx(1, abs=1e-9)
    assert sum(k * pmf(k, mean, shape) for k in support) == pytest.approx(mean, rel=1e-6)
    first, last = support.start, 12
    observed = [np.sum(ks == k) for k in range(first, last)] + [np.sum(ks >= last)]
    expected = [pmf(k, mean, shape) for k in range(first, last)]
    expected = np.array(expected + [1 - sum(expected)]) * len(ks)
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    assert ks.mean() == pytest.approx(mean, rel=0.08)


def test_gamma_is_dp_accountings_truncated_negative_binomial_parameter():
    from dp_accounting.rdp.rdp_privacy_accountant import _gamma_truncated_negative_binomial
    for shape in (0.0, 0.5, 1.0, 3.0):
        assert gamma(10.0, shape) == pytest.approx(_gamma_truncated_negative_binomial(shape, 10.0), rel=1e-8)


def run_event(sigma, q=Q, steps=STEPS):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)


def rdp_epsilon(event, delta=DELTA):
    return rdp.RdpAccountant().compose(event).get_epsilon(delta)


def test_the_selections_epsilon_is_dp_accountings_event_and_the_issues_table():
    """Built here from dp-accounting's own events; and the table the issue gives for the digits task (σ for ε = 2
    alone, mean 10 trials): one run 2.19, the best of 10 composed 7.80, geometric 4.32, TNB(0.5) 4.01."""
    from dpmem.privacy import calibrate_sigma
    sigma = calibrate_sigma(2.0, DELTA, Q, STEPS)
    assert rdp_epsilon(run_event(sigma)) == pytest.approx(2.19, abs=0.005)
    assert rdp_epsilon(dp_accounting.ComposedDpEvent([run_event(sigma)] * 10)) == pytest.approx(7.80, abs=0.005)
    for shape, table in ((1.0, 4.32), (0.5, 4.01)):
        want = rdp_epsilon(dp_event.RepeatAndSelectDpEvent(run_event(sigma), 10, shape))
        assert selection_epsilon(sigma, DELTA, Q, STEPS, 10, shape) == pytest.approx(want, rel=1e-12)
        assert want == pytest.approx(table, abs=0.005)


def test_the_geometric_selection_of_a_gaussian_is_papernot_and_steinkes_closed_form():
    """Theorem 2 of arXiv 2110.03620 with η = 1 (geometric, γ = 1/μ) for a Gaussian mechanism of multiplier σ
    (ε(λ) = λ/2σ²): ε'(λ) = ε(λ) + 2 min over λ̂ of [(1 - 1/λ̂) ε(λ̂) + ln(μ)/λ̂] + ln(μ)/(λ - 1),
    turned into (ε, δ) by min over λ of ε'(λ) + ln(1 - 1/λ) - ln(δλ)/(λ - 1), both over dp-accounting's orders. Written out
    here; dpmem's (a Poisson rate of 1 is the Gaussian itself) must agree."""
    sigma, mean = 3.0, 10.0
    orders = np.array(rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=float)
    base = orders / (2 * sigma ** 2)
    c = 2 * np.min((1 - 1 / orders) * base + math.log(mean) / orders)
    curve = np.where(orders > 1, base + math.log(mean) / np.maximum(orders - 1, 1e-300) + c, np.inf)
    curve = np.array([curve[orders >= a].min() for a in orders])  # monotonicity of Rényi divergences in λ
    usable = orders > 1.01
    closed = np.min(curve[usable] + np.log1p(-1 / orders[usable]) - np.log(DELTA * orders[usable])
                    / (orders[usable] - 1))
    assert selection_epsilon(sigma, DELTA, 1.0, 1, mean, 1.0) == pytest.approx(closed, rel=1e-9)


@pytest.mark.parametrize("shape", [0.0, 1.0, POISSON])
def test_the_calibration_inverts_the_selections_epsilon(shape):
    sigma = calibrate_selection(4.0, DELTA, Q, STEPS, 10, shape)
    assert selection_epsilon(sigma, DELTA, Q, STEPS, 10, shape) == pytest.approx(4.0, abs=1e-3)
    assert selection_epsilon(sigma, DELTA, Q, STEPS, 10, shape) <= 4.0
    # with the loss released in the same ε the gradient's share is smaller: the joint multiplier is the same
    loss = calibrate_selection(4.0, DELTA, Q, STEPS, 10, shape, loss_noise=10.0)
    assert loss / math.sqrt(1 + 1e-2) == pytest.approx(sigma, rel=1e-3)


def test_a_failed_trial_scores_worst_and_the_winner_alone_is_for_release(tmp_path):
    plan = search.Search(10, 1.0, 4.0, DELTA, 1.0, 2.0, "train_loss", "add_remove", "pld")
    folders = []
    for i, loss in enumerate([0.9, None, 0.4]):
        folder = tmp_path / f"{i}_trial"
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps({"sigma": 1.001, "sigma_accounted": 1.0, "sample_rate": Q,
                                                          "steps_done": STEPS, "sampling": "poisson"}))
        folders.append((folder, loss))
    record = search.finish(tmp_path, plan, folders)
    assert record["winner"] == "2_trial" and record["ended"] == "completed" and record["epsilon"] == 4.0
    assert "K" not in record and "trials" not in json.dumps(record).replace("mean_trials", "")
    releases = [json.loads((f / "release.json").read_text()) for f, _ in folders]
    assert [r["for_release"] for r in releases] == [False, False, True]
    three = rdp.RdpAccountant().compose(dp_accounting.ComposedDpEvent([run_event(1.0)] * 3)).get_epsilon(DELTA)
    assert 0.9 * three < releases[0]["epsilon_if_released_too"] < 1.1 * three  # pld's composition beside rdp's
    # a trial that ran with less noise than the selection needs: nothing is released under its ε
    plan.sigma = 1.01
    assert search.finish(tmp_path, plan, folders)["winner"] is None


@pytest.mark.parametrize("overrides,key", [
    (["train.objective=metric"], "train.objective"),
    (["privacy.train_loss=exact"], "privacy.train_loss"),
    (["hydra.sweeper.mean_trials=0.5"], "hydra.sweeper.mean_trials"),
    (["hydra.sweeper.shape=-1"], "hydra.sweeper.shape"),
    (["method=adam"], "method"),
    (["train.batch_size=32,64"], "train.batch_size"),
    (["privacy.epsilon=1e-4"], "privacy.epsilon"),
    (["method=dp-sgd-rc"], "privacy.accountant"),
])
def test_a_private_search_is_refused_in_one_line_before_it_starts(cli, tmp_path, overrides, key):
    space = [] if key == "hydra.sweeper.params" else ["train.lr=tag(log, interval(1e-3, 1e-1))"]
    r = cli("train", "-m", "hydra/sweeper=private", *space, *TINY, *overrides, "hydra.sweep.dir=s")
    assert r.returncode == 2 and r.stderr.startswith(f"dpmem: error: {key}:"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "s").exists()


def test_a_space_with_nothing_to_search_is_refused(cli, tmp_path):
    r = cli("train", "-m", "hydra/sweeper=private", "train.lr=0.01", *TINY, "hydra.sweep.dir=s")
    assert r.returncode == 2 and r.stderr.startswith("dpmem: error: hydra.sweeper.params:"), r.stderr


def test_a_private_search_end_to_end(cli, tmp_path, monkeypatch):
    """A fixed key (in place of the OS's) draws K = 3: three trials, each at the calibrated noise, each with its
    own draw of the space; the lowest private loss wins; selection.json, release.json and the report say so."""
    key = next(seed_key(i) for i in range(100) if draw_trials(2.0, 1.0, derive(seed_key(i), "trials")) == 3)
    monkeypatch.setattr(search, "os_key", lambda: key)
    r = cli("train", "-m", "hydra/sweeper=private", "hydra.sweeper.mean_trials=2", "hydra.sweeper.shape=1",
            "train.lr=tag(log, interval(1e-3, 1e-1))", "method.max_grad_norm=0.5,1.0", "privacy.epsilon=4", *TINY,
            "hydra.sweep.dir=s")
    assert r.returncode == 0, r.stderr
    trials = sorted(p for p in (tmp_path / "s").iterdir() if p.is_dir())
    assert len(trials) == 3
    summaries = [json.loads((t / "summary.json").read_text()) for t in trials]
    record = json.loads((tmp_path / "s" / "selection.json").read_text())
    assert record["epsilon"] == 4.0 and record["law"] == "geometric" and record["ended"] == "completed"
    sigma = record["trial_sigma"]
    assert selection_epsilon(summaries[0]["sigma_accounted"], record["delta"], summaries[0]["sample_rate"], 2, 2.0,
                             1.0) <= 4.0 + 1e-9
    assert all(s["sigma"] >= sigma and s["status"] == "ok" for s in summaries)
    assert len({t.name.split("train.lr=")[1] for t in trials}) == 3  # each trial its own draw
    losses = [s["train_loss"] for s in summaries]
    assert record["winner"] == trials[int(np.argmin(losses))].name
    releases = [json.loads((t / "release.json").read_text())["for_release"] for t in trials]
    assert releases.count(True) == 1 and releases[int(np.argmin(losses))]
    report = cli("report", "s", "--out", "r")
    assert report.returncode == 0 and "Private selections" in report.stdout and "at ε = 4 and δ" in report.stdout


def test_a_search_killed_mid_trial_resumes_with_the_same_number_of_trials(tmp_path):
    """SIGKILL once the first trial has a checkpoint; the same command again: the key (and so K) is the one the
    first start drew, the finished trials are skipped, and the search ends with K trials."""
    command = [sys.executable, "-m", "dpmem", "train", "-m", "hydra/sweeper=private", "hydra.sweeper.mean_trials=1.5",
               "train.lr=tag(log, interval(1e-3, 1e-1))", *TINY, "train.steps=6", "train.checkpoint_every=1",
               f"hydra.sweep.dir={tmp_path / 's'}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 240
    while not list((tmp_path / "s").glob("0_*/checkpoint.pt")) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    key = (tmp_path / "s" / "selection.key").read_text()
    assert not (tmp_path / "s" / "selection.json").exists()
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert (tmp_path / "s" / "selection.key").read_text() == key
    k = draw_trials(1.5, 1.0, derive(bytes.fromhex(json.loads(key)["key"]), "trials"))
    trials = [p for p in (tmp_path / "s").iterdir() if p.is_dir()]
    assert len(trials) == k and json.loads((tmp_path / "s" / "selection.json").read_text())["ended"] == "completed"
    resumed = json.loads(next((tmp_path / "s").glob("0_*/summary.json")).read_text())
    assert resumed["resumed_from_step"] is not None and resumed["status"] == "ok"
    # another law in the same folder is refused before anything runs, naming the folder's key
    other = subprocess.run([*command, "hydra.sweeper.shape=0"], env=env, capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and other.stderr.startswith("dpmem: error: hydra.sweep.dir:"), other.stderr
