"""Private hyperparameter selection (hydra/sweeper=private; dpmem.privacy.selection, dpmem.engine.selection): the
law of the number of trials K, the selection's ε against dp-accounting's event built here and against Papernot &
Steinke's closed form, the calibration, a search end to end, its refusals, and a resume after SIGKILL."""

import ctypes
import errno
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import dp_event, pld, rdp
from scipy import stats

from dpmem.config import ConfigError
from dpmem.engine import selection as search
from dpmem.privacy.randomness import derive, seed_key
from dpmem.privacy.selection import POISSON, calibrate_selection, draw_trials, gamma, pmf, selection_epsilon

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


def trials_of(folder, plan, losses, sigma=1.001):
    """A search's state in `folder` (a fresh key) and a trial folder per loss (None: failed), as the sweeper names
    them."""
    state = search.SearchState(folder, plan, [], [search.Dimension("train.lr", values=(0.1, 0.2))])
    results = []
    for i, loss in enumerate(losses):
        trial = folder / state.name(i)
        trial.mkdir()
        (trial / "summary.json").write_text(json.dumps({"sigma": sigma, "sigma_accounted": 1.0, "sample_rate": Q,
                                                         "steps_done": STEPS, "sampling": "poisson"}))
        (trial / "config.yaml").write_text(f"trial: {i}\n")
        results.append((trial, loss))
    return state, results, [[f"train.lr=0.{i + 1}"] for i in range(len(losses))]


def test_a_failed_trial_scores_worst_and_the_release_is_the_winner_alone(tmp_path):
    """selection/ holds selection.json and the winner's config.yaml (no model.pt: the winner kept none here), and
    none of it names a trial's folder or position; the holder's search.json does; every trial's own folder says it
    is not for release."""
    plan = search.Search(10, 1.0, 4.0, DELTA, 1.0, 2.0, "train_loss", "add_remove", "pld")
    state, results, points = trials_of(tmp_path, plan, [0.9, None, 0.4])
    record = search.finish(tmp_path, plan, state, results, points)
    released = tmp_path / search.RELEASED
    assert sorted(p.name for p in released.iterdir()) == record["files"] == ["config.yaml", "selection.json"]
    assert (released / "config.yaml").read_text() == "trial: 2\n" and record["hyperparameters"] == {"train.lr": "0.3"}
    assert record["ended"] == "completed" and record["epsilon"] == 4.0
    text = "".join(p.read_text() for p in released.iterdir())
    assert not any(r.name in text or r.name[len(search.TRIAL):] in text for r, _ in results)
    assert not {"winner", "trials", "K", "index", "position"} & set(json.loads((released / "selection.json")
                                                                               .read_text()))
    holder = json.loads((tmp_path / search.HOLDER).read_text())
    assert holder["winner"] == results[2][0].name and [t["score"] for t in holder["trials"]] == [0.9, None, 0.4]
    releases = [json.loads((f / "release.json").read_text()) for f, _ in results]
    assert [r["for_release"] for r in releases] == [False, False, False] and "the winner" in releases[2]["why"]
    three = rdp.RdpAccountant().compose(dp_accounting.ComposedDpEvent([run_event(1.0)] * 3)).get_epsilon(DELTA)
    assert 0.9 * three < releases[0]["epsilon_if_released_too"] < 1.1 * three  # pld's composition beside rdp's
    # a trial that ran with less noise than the selection needs: nothing is released under its ε
    plan.sigma = 1.01
    record = search.finish(tmp_path, plan, state, results, points)
    assert record["epsilon"] == 0.0 and "hyperparameters" not in record
    assert [p.name for p in released.iterdir()] == ["selection.json"]


def test_ties_are_broken_uniformly_by_the_key_not_by_position(tmp_path):
    """Three trials of one score: over 3,000 keys each wins a third of the time (χ²); the first-index rule fails."""
    plan = search.Search(10, 1.0, 4.0, DELTA, 1.0, 2.0, "train_loss", "add_remove", "pld")
    state = search.SearchState(tmp_path, plan, [], [search.Dimension("train.lr", values=(0.1,))])
    wins = np.zeros(3)
    for i in range(3000):
        state.key = seed_key(i)
        wins[state.tie([0, 1, 2])] += 1
    assert stats.chisquare(wins).pvalue > 1e-3
    assert stats.chisquare([3000, 0, 0]).pvalue < 1e-3  # what always taking the first would give


@pytest.mark.long
def test_a_private_search_folder_is_its_own(cli, tmp_path):
    """Into a finished training run's folder, a folder of other files, a search whose selection.key was deleted
    (a new key would draw a new K), a search's release published, or while another search holds the folder:
    refused in one line, nothing written."""
    from dpmem.engine.folder import FolderLock
    space = ["hydra/sweeper=private", "train.lr=tag(log, interval(1e-3, 1e-1))", *TINY]
    assert cli("train", *TINY, "hydra.run.dir=run").returncode == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "lost" / "trial-0123").mkdir(parents=True)
    (tmp_path / "published").mkdir()
    (tmp_path / "published" / "selection.json").write_text("{}")
    for folder, said in (("run", "files of its own"), ("mine", "files of its own (notes.txt)"),
                         ("lost", "a private search whose selection.key is gone"),
                         ("published", "a private search's release")):
        before = sorted(p.name for p in (tmp_path / folder).iterdir())
        r = cli("train", "-m", *space, f"hydra.sweep.dir={folder}")
        assert r.returncode == 2 and r.stderr.startswith("dpmem: error: hydra.sweep.dir:"), r.stderr
        assert said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == before
    with FolderLock(tmp_path / "held", "hydra.sweep.dir"):  # a second search, as the first one runs
        r = cli("train", "-m", *space, "hydra.sweep.dir=held")
    assert r.returncode == 2 and "held is being written by another dpmem run" in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("dpmem: error: hydra.sweep.dir:"), r.stderr
    assert not (tmp_path / "held" / search.KEY_FILE).exists()


@pytest.mark.parametrize("overrides,key", [
    (["train.objective=metric"], "train.objective"),
    (["privacy.train_loss=exact"], "privacy.train_loss"),
    (["hydra.sweeper.mean_trials=0.5"], "hydra.sweeper.mean_trials"),
    (["hydra.sweeper.shape=-1"], "hydra.sweeper.shape"),
    (["method=adam"], "method"),
    (["train.batch_size=32,64"], "train.batch_size"),
    (["privacy.epsilon=1e-4"], "privacy.epsilon"),
    (["privacy.noise_seed=5"], "privacy.noise_seed"),
    (["privacy.sampler_seed=5"], "privacy.sampler_seed"),
    (["hydra.sweeper.mean_trials=1e9"], "hydra.sweeper.mean_trials"),
    (["hydra.sweeper.params.train.lr=tag(log, interval(1e-3, 1e-1))"], "hydra.sweeper.params.train.lr"),
    (["method=dp-sgd-rc"], "privacy.accountant"),
    (["privacy.unit=user", "data.users=300", "privacy.records_per_user=4", "privacy.user_sampling=records"],
     "privacy.user_sampling"),
    (["logging.wandb.enabled=true"], "logging.wandb.enabled"),
    (["logging.wandb.enabled=true,false"], "logging.wandb.enabled"),
])
def test_a_private_search_is_refused_in_one_line_before_it_starts(cli, tmp_path, overrides, key):
    """ELS's (no user-level RDP curve) says why and names ULS; a tracker's, what its runs would publish."""
    space = [] if key == "hydra.sweeper.params" else ["train.lr=tag(log, interval(1e-3, 1e-1))"]
    r = cli("train", "-m", "hydra/sweeper=private", *space, *TINY, *overrides, "hydra.sweep.dir=s")
    assert r.returncode == 2 and r.stderr.startswith(f"dpmem: error: {key}:"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "s").exists()
    said = {"privacy.user_sampling": ("MixtureOfGaussiansDpEvent", "privacy.user_sampling=users"),
            "logging.wandb.enabled": ("every trial, and K",)}.get(key, ())
    assert all(w in r.stderr for w in said), r.stderr


def test_a_space_with_nothing_to_search_is_refused(cli, tmp_path):
    r = cli("train", "-m", "hydra/sweeper=private", "train.lr=0.01", *TINY, "hydra.sweep.dir=s")
    assert r.returncode == 2 and r.stderr.startswith("dpmem: error: hydra.sweeper.params:"), r.stderr


@pytest.mark.long
def test_a_private_search_end_to_end(cli, tmp_path, monkeypatch):
    """A fixed key (in place of the OS's) draws K = 3: three trials, each at the calibrated noise, each with its
    own draw of the space; the lowest private loss wins. What is released (selection/) is the winner's config, weights
    and selection.json, none of which tells K or the winner's position; the console says neither; the report shows
    the release alone (the trials only in the holder's view), at an ε that an edit of selection.json cannot lower."""
    key = next(seed_key(i) for i in range(100) if draw_trials(2.0, 1.0, derive(seed_key(i), "trials")) == 3)
    monkeypatch.setattr(search, "os_key", lambda: key)
    r = cli("train", "-m", "hydra/sweeper=private", "hydra.sweeper.mean_trials=2", "hydra.sweeper.shape=1",
            "train.lr=tag(log, interval(1e-3, 1e-1))", "method.max_grad_norm=0.5,1.0", "privacy.epsilon=4", *TINY,
            "hydra.sweep.dir=s")
    assert r.returncode == 0, r.stderr
    trials = sorted((tmp_path / "s").glob(search.TRIAL + "*"))
    assert len(trials) == 3
    summaries = [json.loads((t / "summary.json").read_text()) for t in trials]
    released = tmp_path / "s" / search.RELEASED
    record = json.loads((released / "selection.json").read_text())
    assert record["epsilon"] == 4.0 and record["law"] == "geometric" and record["ended"] == "completed"
    sigma = record["trial_sigma"]
    assert selection_epsilon(summaries[0]["sigma_accounted"], record["delta"], summaries[0]["sample_rate"], 2, 2.0,
                             1.0) <= 4.0 + 1e-9
    assert all(s["sigma"] >= sigma and s["status"] == "ok" for s in summaries)
    assert len({s["lr"] for s in summaries}) == 3  # each trial its own draw
    best = trials[int(np.argmin([s["train_loss"] for s in summaries]))]
    assert json.loads((tmp_path / "s" / search.HOLDER).read_text())["winner"] == best.name
    assert sorted(p.name for p in released.iterdir()) == ["config.yaml", "model.pt", "selection.json"]
    assert (released / "config.yaml").read_text() == (best / "config.yaml").read_text()
    weights, theirs = (torch.load(f / "model.pt", weights_only=True) for f in (released, best))
    assert weights.keys() == theirs.keys() and all(torch.equal(weights[k], theirs[k]) for k in weights)
    assert [t for t in trials if (t / "model.pt").exists()] == [best]  # the others' weights removed
    assert record["result"]["train_loss"] == min(s["train_loss"] for s in summaries)
    text = (released / "selection.json").read_text() + (released / "config.yaml").read_text()
    assert not any(t.name[len(search.TRIAL):] in text for t in trials) and "job" not in text
    # the console: the search's first and last lines, nothing of a trial (Hydra's "Launching 3 jobs", "#0 : ...")
    console = r.stdout + r.stderr
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 2, console
    assert not any(w in console for w in ("Launching", "#0", "#2", search.TRIAL, "lr=", "3 ")), console
    assert (tmp_path / "s" / search.TRIALS_LOG).read_text().count("run folder") == 3  # the trials said it: the holder
    report = cli("report", "s", "--out", "r")
    rows = [line for line in report.stdout.splitlines() if line.startswith("| grape")]
    assert report.returncode == 0 and len(rows) == 1 and "| 4 |" in rows[0], report.stdout
    assert "at ε = 4 and δ" in report.stdout and search.TRIAL not in report.stdout
    holder = cli("report", "s", "--holder", "--out", "h")
    assert len([line for line in holder.stdout.splitlines() if line.startswith("| grape")]) == 3
    assert holder.stdout.startswith("**The holder's view, not for release**")
    # selection.json edited to a smaller ε and mean, the key's law and the trials' σ too: the report shows the ε
    # their configs, .hydra/ and selection.json's own trial σ give (dp-accounting's event, built here from the
    # unedited summaries and that σ)
    (released / "selection.json").write_text(json.dumps({**record, "epsilon": 0.5, "mean_trials": 1.0}))
    saved = json.loads((tmp_path / "s" / search.KEY_FILE).read_text())
    saved["search"]["mean_trials"] = 1.0
    (tmp_path / "s" / search.KEY_FILE).write_text(json.dumps(saved))
    for t, summary in zip(trials, summaries):
        (t / "summary.json").write_text(json.dumps({**summary, "sigma_accounted": 3 * summary["sigma_accounted"]}))
    s = summaries[0]
    want = rdp_epsilon(dp_event.RepeatAndSelectDpEvent(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(s["sample_rate"], dp_accounting.GaussianDpEvent(
            min([record["trial_sigma_accounted"], *(t["sigma_accounted"] for t in summaries)]))), 2), 2.0, 1.0),
        record["delta"])
    edited = cli("report", "s", "--out", "r2")
    (row,) = [line for line in edited.stdout.splitlines() if line.startswith("| grape")]
    assert float(row.split("|")[2]) == pytest.approx(want, rel=1e-3) and 3.5 < want <= 4.0 + 1e-9
    assert "says ε 0.5 where its trials' noise, rate and steps give" in edited.stdout


# a sitecustomize for the first start of the killed search: after its first checkpoint is saved, the process says so
# in a file and waits to be killed
HOLD_AFTER_A_CHECKPOINT = """
import os, pathlib, time
from dpmem.engine import checkpoint
_save = checkpoint.save
def save(*args, **kwargs):
    _save(*args, **kwargs)
    pathlib.Path(os.environ["DPMEM_TEST_MARKER"]).touch()
    time.sleep(600)
checkpoint.save = save
"""


@pytest.mark.long
def test_a_search_killed_mid_trial_resumes_with_the_same_number_of_trials(tmp_path, cli):
    """SIGKILL once the first trial has a checkpoint; the same command again: the key (and so K) is the one the
    first start drew, the finished trials are skipped, and the search ends with K trials."""
    arguments = ["train", "-m", "hydra/sweeper=private", "hydra.sweeper.mean_trials=1.5",
                 "train.lr=tag(log, interval(1e-3, 1e-1))", *TINY, "train.steps=6", "train.checkpoint_every=1",
                 f"hydra.sweep.dir={tmp_path / 's'}"]
    command = [sys.executable, "-m", "dpmem", *arguments]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # the first start holds still after its first checkpoint until it is killed: polling for checkpoint.pt raced a
    # trial that finished (and removed it) between two looks, and then waited out its deadline
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLD_AFTER_A_CHECKPOINT)
    marker = tmp_path / "checkpointed"
    log = tmp_path / "first.log"
    with log.open("w") as err:
        first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                 env={**env, "PYTHONPATH": os.pathsep.join([str(hold), env.get("PYTHONPATH", "")]),
                                      "DPMEM_TEST_MARKER": str(marker)})
    deadline = time.monotonic() + 240
    while not marker.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), log.read_text()[-2000:]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    key = (tmp_path / "s" / "selection.key").read_text()
    assert not (tmp_path / "s" / search.RELEASED).exists()
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    # Hydra's own logging on (as a user's console has it): its count of the jobs goes to the holder's log alone
    assert "Launching" not in second.stdout + second.stderr and len(second.stderr.strip().splitlines()) == 2
    assert "Launching" in (tmp_path / "s" / search.TRIALS_LOG).read_text()
    assert (tmp_path / "s" / "selection.key").read_text() == key
    k = draw_trials(1.5, 1.0, derive(bytes.fromhex(json.loads(key)["key"]), "trials"))
    trials = list((tmp_path / "s").glob("trial-*"))
    assert len(trials) == k and json.loads((tmp_path / "s" / search.RELEASED / "selection.json").read_text())[
        "ended"] == "completed"
    first_trial = search.TRIAL + derive(bytes.fromhex(json.loads(key)["key"]), "folder", 0).hex()[:16]
    resumed = json.loads((tmp_path / "s" / first_trial / "summary.json").read_text())
    assert resumed["resumed_from_step"] is not None and resumed["status"] == "ok"
    # another law in the same folder is refused before anything runs, naming the folder's key (in this process: the
    # refusal, not a process, is what is checked, and a fresh interpreter costs seconds)
    other = cli(*arguments, "hydra.sweeper.shape=0")
    assert other.returncode == 2 and other.stderr.startswith("dpmem: error: hydra.sweep.dir:"), other.stderr


@pytest.mark.long
def test_ctrl_c_in_a_private_search_ends_in_one_line_and_the_same_command_resumes(cli, tmp_path, monkeypatch):
    from dpmem.engine import trainer
    real = trainer.run_training

    def interrupted(cfg, run_dir):
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer, "run_training", interrupted)
    # a mean of 1.5 trials (the default 10 drew K from the OS's key: a resumed search of up to dozens of trials)
    command = ["train", "-m", "hydra/sweeper=private", "hydra.sweeper.mean_trials=1.5",
               "train.lr=tag(log, interval(1e-3, 1e-1))", *TINY, "hydra.sweep.dir=s"]
    r = cli(*command)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith("was interrupted: the same command resumes it (the same K and "
                                                      "trials; finished trials are skipped)"), r.stderr
    monkeypatch.setattr(trainer, "run_training", real)
    r = cli(*command)
    assert r.returncode == 0 and (tmp_path / "s" / search.RELEASED / "selection.json").exists(), r.stderr


def test_a_key_cut_short_before_any_trial_is_drawn_again_and_one_after_is_refused(tmp_path):
    """A 0-byte selection.key (a full disk as the search began) with nothing else: no trial ran, so a new key is
    drawn; beside a trial's folder it is refused (its K cannot be known)."""
    plan = search.Search(10, 1.0, 4.0, DELTA, 1.0, 2.0, "train_loss", "add_remove", "pld")
    dims = [search.Dimension("train.lr", values=(0.1,))]
    (tmp_path / search.KEY_FILE).write_bytes(b"")
    state = search.SearchState(tmp_path, plan, [], dims)
    assert json.loads((tmp_path / search.KEY_FILE).read_text())["key"] == state.key.hex()
    assert oct((tmp_path / search.KEY_FILE).stat().st_mode & 0o777) == "0o600"
    (tmp_path / search.KEY_FILE).write_bytes(b"")
    (tmp_path / state.name(0)).mkdir()
    with pytest.raises(ConfigError, match=r"hydra\.sweep\.dir: .*selection\.key cannot be read"):
        search.SearchState(tmp_path, plan, [], dims)


def test_els_has_no_selection_bound_and_is_refused_not_accounted_as_a_record(tmp_path):
    """dp-accounting's RDP accountant cannot compose ELS's step (a mixture of Gaussians), and so no repeat-and-select
    of it: the selection refuses a user's k records rather than account a record's event. Several ELS runs composed
    (the report's `search_privacy`) are dp-accounting's PLD of the mixtures, built here."""
    from dpmem.privacy.accounting import PLD_DISCRETIZATION
    from dpmem.report.runs import search_privacy

    sigma, q, steps, k = 4.0, 0.1, 5, 2
    mixture = dp_accounting.SelfComposedDpEvent(dp_event.MixtureOfGaussiansDpEvent(
        sigma, list(range(k + 1)), [float(p) for p in stats.binom.pmf(range(k + 1), k, q)]), steps)
    assert not rdp.RdpAccountant().supports(dp_event.RepeatAndSelectDpEvent(mixture, 10, 1.0))
    with pytest.raises(ValueError, match="MixtureOfGaussiansDpEvent.*privacy.user_sampling=users"):
        selection_epsilon(sigma, DELTA, q, steps, 10, 1.0, user_records=k)
    with pytest.raises(ValueError, match="MixtureOfGaussiansDpEvent"):
        calibrate_selection(4.0, DELTA, q, steps, 10, 1.0, user_records=k)
    runs = [{"status": "ok", "method": "dp-adam", "data": "digits", "run_dir": str(tmp_path / f"els{i}"),
             "config": {"privacy.unit": "user"}, "ledger": [], "accountant": "pld", "delta": DELTA, "sigma": sigma,
             "sigma_accounted": sigma, "sample_rate": q, "steps_done": steps, "sampling": "poisson",
             "unit": "user", "user_sampling": "records", "records_per_user": k, "epsilon_spent": 1.0}
            for i in range(2)]
    (line,) = [w for w in search_privacy(runs) if "releasing a result chosen among them" in w]
    want = pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION).compose(
        dp_accounting.ComposedDpEvent([mixture, mixture])).get_epsilon(DELTA)
    composed = float(line.split("ε = ")[1].split()[0])
    assert composed == pytest.approx(want, rel=1e-3), line
    record = pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION).compose(
        dp_accounting.ComposedDpEvent([run_event(sigma, q, steps)] * 2)).get_epsilon(DELTA)
    assert composed > 1.2 * record  # what composing the record-level events would have under-stated


def birth_time(path) -> float | None:
    """A file's birth time, where Python (st_birthtime) or the kernel (statx, read here through libc) gives one."""
    stat = os.stat(path)
    if hasattr(stat, "st_birthtime"):
        return stat.st_birthtime
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "statx"):
        return None
    buffer = ctypes.create_string_buffer(256)  # struct statx: mask at 0, ino at 32, btime at 80
    if libc.statx(-100, os.fsencode(path), 0, 0x800, buffer) != 0:  # AT_FDCWD, STATX_BTIME
        return None
    mask, (ino,), (seconds, nanoseconds) = (int.from_bytes(buffer.raw[:4], "little"),
                                            struct.unpack_from("<Q", buffer.raw, 32),
                                            struct.unpack_from("<qI", buffer.raw, 80))
    assert ino == stat.st_ino  # the layout read right
    return seconds + nanoseconds / 1e9 if mask & 0x800 else None


def released_files_are_new(released, trials, before: float | None):
    """Every file of selection/ is one of its own: one link, an inode no trial's file has, born at or after
    `before` (where the file system says; the birth time of a file made just before the release was written)."""
    inodes = {p.stat().st_ino for t in trials for p in t.rglob("*") if p.is_file()}
    for path in released.iterdir():
        stat = os.stat(path)
        assert stat.st_nlink == 1 and stat.st_ino not in inodes, path
        if before is not None:
            assert birth_time(path) >= before, path


def test_the_release_is_new_files_and_a_full_disk_as_it_is_written_says_what_is_missing_in_one_line(
        tmp_path, monkeypatch):
    """The winner's weights copied into a new file (a link would share the trial's inode, link count and birth time,
    which tell how many trials ran after it). A write that finds the disk full: one line saying what was not
    written and that the same command finishes the search; nothing half-made is left, and the search then
    finishes."""
    from dpmem.engine import summary
    plan = search.Search(10, 1.0, 4.0, DELTA, 1.0, 2.0, "train_loss", "add_remove", "pld")
    state, results, points = trials_of(tmp_path, plan, [0.9, 0.4])
    for trial, _ in results:
        (trial / "model.pt").write_bytes(os.urandom(3 << 20))  # more than one chunk of the copy
    winner = (results[1][0] / "model.pt").read_bytes()
    time.sleep(0.05)  # (file times tick by the kernel's coarse clock)
    (tmp_path / "marker").write_bytes(b"")
    before = birth_time(tmp_path / "marker")
    copy = shutil.copyfileobj

    def full(source, target, *args):
        copy(source, target, 1 << 20)  # a part written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shutil, "copyfileobj", full)
    with pytest.raises(ConfigError) as e:
        search.finish(tmp_path, plan, state, results, points)
    said = str(e.value)
    assert said.startswith(f"hydra.sweep.dir: {tmp_path / 'selection'}: the disk is full: ") and "\n" not in said
    assert "its release (selection/) was not written" in said and "run the same command again" in said, said
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(search.TRIAL)) == [
        "marker", search.KEY_FILE]  # no selection.tmp, no release, no holder's record yet
    assert all((t / "model.pt").exists() for t, _ in results)  # no weights removed before the release is whole
    monkeypatch.setattr(shutil, "copyfileobj", copy)
    real = summary.replace_file

    def holder_full(path, data):
        if path.name == search.HOLDER:
            raise summary.DiskFull(path, len(data))
        real(path, data)
    monkeypatch.setattr(summary, "replace_file", holder_full)
    with pytest.raises(ConfigError, match=r"search.json: the disk is full: the search's release \(selection/\) is "
                       "written, but not the holder's search.json"):
        search.finish(tmp_path, plan, state, results, points)
    monkeypatch.setattr(summary, "replace_file", real)
    record = search.finish(tmp_path, plan, state, results, points)  # the same command again
    released = tmp_path / search.RELEASED
    assert record["ended"] == "completed" and (released / "model.pt").read_bytes() == winner
    assert sorted(p.name for p in released.iterdir()) == ["config.yaml", "model.pt", "selection.json"]
    released_files_are_new(released, [t for t, _ in results], before)


def test_a_selection_alone_is_accounted_by_its_own_trial_event_never_by_its_epsilon_field(tmp_path):
    """The trials, search.json and selection.key deleted, and selection.json's ε edited down: the ε is what its law,
    the trials' σ, rate and steps give (dp-accounting's event, built here), the edit named beside it. Without those,
    or with trials that ran under ELS (an older dpmem's search), ε ∞."""
    sigma = 1.2
    plan = search.Search(10, 1.0, 4.0, DELTA, sigma, 2.0, "train_loss", "add_remove", "pld", "record", sigma, Q,
                         STEPS)
    state, results, points = trials_of(tmp_path, plan, [0.9, 0.4], sigma=sigma)
    search.finish(tmp_path, plan, state, results, points)
    for trial, _ in results:
        shutil.rmtree(trial)
    (tmp_path / search.HOLDER).unlink()
    (tmp_path / search.KEY_FILE).unlink()
    path = tmp_path / search.RELEASED / "selection.json"
    record = {**json.loads(path.read_text()), "epsilon": 0.5}
    want = rdp_epsilon(dp_event.RepeatAndSelectDpEvent(run_event(sigma), 10, 1.0))
    epsilon, note = search.released_epsilon(tmp_path, record)
    assert epsilon == pytest.approx(want, rel=1e-9) and epsilon > 1
    assert f"says ε 0.5 where its trials' noise, rate and steps give {want:.4g}" in note
    assert search.released_epsilon(tmp_path / search.RELEASED, record)[0] == epsilon  # the release published alone
    epsilon, note = search.released_epsilon(tmp_path, {**record, "trial_sigma_accounted": None})
    assert epsilon == math.inf and "cannot be recomputed" in note
    (tmp_path / (search.TRIAL + "0")).mkdir()
    (tmp_path / (search.TRIAL + "0") / "summary.json").write_text(json.dumps(
        {"sigma": sigma, "sample_rate": Q, "steps_done": STEPS, "unit": "user", "user_sampling": "records"}))
    epsilon, note = search.released_epsilon(tmp_path, record)
    assert epsilon == math.inf and "MixtureOfGaussiansDpEvent" in note


def test_no_verb_writes_into_a_private_searchs_folder_or_its_release(tmp_path):
    """Whatever train.overwrite says: the search's folder, its selection/ (or a copy of it elsewhere), and a folder
    in the search's folder that is not a trial the search runs."""
    from dpmem.engine.folder import FolderRefused, check_owner
    (tmp_path / "s" / search.RELEASED).mkdir(parents=True)
    (tmp_path / "s" / search.KEY_FILE).write_text("{}")
    (tmp_path / "s" / search.RELEASED / "selection.json").write_text("{}")
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "selection.json").write_text("{}")
    for folder, said in (("s", "a private search's folder"), ("s/selection", "a private search's release"),
                         ("copy", "a private search's release"), ("s/mine", "inside a private search's folder"),
                         ("s/trial-0123", "inside a private search's folder")):
        for tool in ("train", "audit"):
            with pytest.raises(FolderRefused, match=f"{said}.*dpmem {tool} never writes there, whatever "
                               "train.overwrite says"):
                check_owner(tmp_path / folder, tool, True)
    check_owner(tmp_path / "elsewhere", "train", False)


@pytest.mark.long
def test_a_user_level_search_its_release_alone_and_after_a_clean_up_and_no_run_over_it(cli, tmp_path):
    """A ULS search (mean 1: one trial): selection.json and both console lines say ε per user; every file of
    selection/ is a new one; a run into selection/ or the search's folder is refused whatever train.overwrite says,
    nothing touched; the release published alone (under another name) is reported as the one row it is, per user;
    after the holder deletes the trials, search.json and selection.key and edits selection.json's ε to 0.5, the
    report shows the ε its law and trial event give (dp-accounting's, built here), the 0.5 named beside it."""
    users = ["privacy.unit=user", "data.users=300", "privacy.records_per_user=4"]
    r = cli("train", "-m", "hydra/sweeper=private", "hydra.sweeper.mean_trials=1",
            "train.lr=tag(log, interval(1e-3, 1e-1))", "privacy.epsilon=4", *users, *TINY, "hydra.sweep.dir=s")
    assert r.returncode == 0 and r.stderr.count("ε = 4 per user") == 2, r.stderr
    released = tmp_path / "s" / search.RELEASED
    record = json.loads((released / "selection.json").read_text())
    assert record["unit"] == "user" and "per user" in record["guarantee"]
    assert record["trial_sample_rate"] == pytest.approx(64 / record["dataset_size"])  # ULS samples users
    (trial,) = (tmp_path / "s").glob(search.TRIAL + "*")
    written = [birth_time(p) for p in trial.rglob("*") if p.is_file() and p.name != search.RELEASE]
    released_files_are_new(released, [trial], None if None in written else max(written))
    files = {p.name: p.read_bytes() for p in released.iterdir()}
    for folder, what in (("s/selection", "a private search's release"), ("s", "a private search's folder")):
        r = cli("train", *TINY, *users, f"hydra.run.dir={folder}", "train.overwrite=true")
        assert r.returncode == 2 and r.stderr.startswith("dpmem: error: hydra.run.dir:") and what in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert {p.name: p.read_bytes() for p in released.iterdir()} == files
    shutil.copytree(released, tmp_path / "published")
    alone = cli("report", "published", "--out", "r1")
    (row,) = [line for line in alone.stdout.splitlines() if line.startswith("| grape")]
    assert alone.returncode == 0 and "| 4 (per user) |" in row, alone.stdout
    assert "Not in the table" not in alone.stdout, alone.stdout
    shutil.rmtree(trial)
    for name in (search.HOLDER, search.KEY_FILE):
        (tmp_path / "s" / name).unlink()
    (released / "selection.json").write_text(json.dumps({**record, "epsilon": 0.5}))
    want = rdp_epsilon(dp_event.RepeatAndSelectDpEvent(run_event(
        record["trial_sigma_accounted"], record["trial_sample_rate"], record["trial_steps"]), 1.0, 1.0),
        record["delta"])
    edited = cli("report", "s", "--out", "r2")
    (row,) = [line for line in edited.stdout.splitlines() if line.startswith("| grape")]
    assert float(row.split("|")[2].split()[0]) == pytest.approx(want, rel=1e-3) and "(per user)" in row, row
    assert 3.5 < want <= 4 + 1e-9 and "says ε 0.5 where its trials' noise, rate and steps give" in edited.stdout
