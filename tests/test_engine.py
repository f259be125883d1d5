"""The engine in-process: a crash leaves a summary that says what was done; samplers match their definitions."""

import json

import pytest
import torch

from dpmem.engine.trainer import Run, lr_at, run_training
from dpmem.methods.dp_adam import DPAdam
from dpmem.privacy.randomness import Draws, seed_key
from dpmem.privacy.sampling import fixed_batches, poisson_batches, shuffled_batches
from helpers import config


def test_a_crash_leaves_a_readable_summary(tmp_path, monkeypatch):
    real_step, calls = DPAdam.step, []

    def failing_step(self, micro, loss_fn):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real_step(self, micro, loss_fn)

    monkeypatch.setattr(DPAdam, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        run_training(config("method=dp-adam"), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "boom" in summary["error"]
    assert summary["steps_done"] == 2 and summary["epsilon_spent"] > 0 and summary["wall_time_s"] > 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped one, on purpose
def test_ctrl_c_in_a_weakref_callback_still_stops_the_run(tmp_path, monkeypatch):
    """Python prints and drops an exception raised in a weakref callback (the live-tensor counter runs one per
    freed tensor): Ctrl-C landing there must still end the run, at the next step."""
    import os
    import signal
    import weakref
    real_step, calls = DPAdam.step, []

    def step(self, micro, loss_fn):
        calls.append(1)
        if len(calls) == 2:
            t = torch.zeros(1)
            weakref.finalize(t, lambda: (os.kill(os.getpid(), signal.SIGINT), sum(range(1000))))
            del t  # the callback runs here; the handler's KeyboardInterrupt is raised inside it and dropped
        return real_step(self, micro, loss_fn)

    monkeypatch.setattr(DPAdam, "step", step)
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a job started in the background
    with pytest.raises(KeyboardInterrupt):
        run_training(config("method=dp-adam"), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps_done"] == 2
    assert signal.getsignal(signal.SIGINT) is before  # the run's handler is gone


def test_poisson_sampling_rate_and_independence():
    gen = Draws(seed_key(0), "batches")
    n, q, steps = 1000, 0.05, 400
    sizes = torch.tensor([len(b) for b in poisson_batches(n, q, steps, gen)], dtype=torch.float)
    # Binomial(n, q): mean nq = 50, std sqrt(nq(1-q)) ~ 6.9; the mean of 400 draws is within 4 s.e.
    assert abs(sizes.mean() - n * q) < 4 * (n * q * (1 - q) / steps) ** 0.5
    assert sizes.std() == pytest.approx((n * q * (1 - q)) ** 0.5, rel=0.15)


def test_fixed_and_shuffled_batches():
    gen = Draws(seed_key(0), "batches")
    assert all(len(b) == 7 and len(set(b.tolist())) == 7 for b in fixed_batches(20, 7, 10, gen))
    epoch = list(shuffled_batches(20, 7, 3, gen))
    assert [len(b) for b in epoch] == [7, 7, 6] and sorted(torch.cat(epoch).tolist()) == list(range(20))


def test_learning_rate_schedules():
    cfg = config("train.lr=1.0", "train.warmup_steps=2", "train.schedule=linear").train
    assert [round(lr_at(s, 6, cfg), 3) for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    cfg = config("train.lr=1.0", "train.schedule=cosine").train
    assert lr_at(0, 10, cfg) == 1.0 and lr_at(5, 10, cfg) == pytest.approx(0.5)


def test_dp_adam_holds_more_live_memory_than_adam(tmp_path):
    """Materialised per-sample gradients cost B·d: the exact live-tensor counter must see dp-adam above adam."""
    peaks = {}
    for method in ("adam", "dp-adam"):
        # (the batches seeded: a private run's Poisson batch sizes are the OS's draw, and the peak follows them)
        extra = ["method.clipping=materialize", "privacy.sampler_seed=0"] if method == "dp-adam" else []
        s = run_training(config(f"method={method}", "logging.memory_steps=2", "train.device=cpu", *extra),
                         tmp_path / method)
        assert s["peak_memory_source"] == "live_tensors"
        peaks[method] = s["peak_memory_bytes"]
    # adam holds about 4·d (weights, gradient, two moments) plus small activations; dp-adam adds 32·d
    assert peaks["dp-adam"] > 2 * peaks["adam"], peaks


def test_a_delta_of_one_over_n_warns_once_and_is_recorded(tmp_path, capsys):
    run = Run(config("privacy.delta=1/n"), tmp_path)
    run.prepare()
    assert capsys.readouterr().err.count("warning: delta") == 1
    assert run.summary["delta"] == pytest.approx(1 / 1437) and run.summary["delta_times_n"] == pytest.approx(1.0)
    run.method.close()
    run = Run(config("privacy.delta=1e-6"), tmp_path)
    run.prepare()
    assert "warning" not in capsys.readouterr().err and run.summary["delta_times_n"] == pytest.approx(1437e-6)
    run.method.close()


def test_a_non_finite_loss_fails_the_run_with_the_epsilon_spent(tmp_path, monkeypatch):
    """A NaN pixel with the coverage check off: the run stops at the next logged step, failed, its ε recorded."""
    from dpmem.data import digits
    real = digits.load

    def poisoned(cfg):
        data = real(cfg)
        data.train["pixel_values"][:] = float("nan")
        return data
    monkeypatch.setattr(digits, "load", poisoned)
    from dpmem.engine.trainer import NonFiniteLoss
    with pytest.raises(NonFiniteLoss, match="nan"):
        run_training(config("method=dp-adam", "method.check_coverage=false", "privacy.epsilon=8",
                            "train.device=cpu", "logging.every=2"), tmp_path)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "failed" and "NonFiniteLoss" in s["error"] and s["steps_done"] == 2
    assert 0 < s["epsilon_spent"] < 8


@pytest.mark.parametrize("override,key", [("train.lr=nan", "train.lr"), ("train.lr=inf", "train.lr"),
                                          ("method.max_grad_norm=inf", "method.max_grad_norm")])
def test_non_finite_hyperparameters_are_refused(override, key):
    from dpmem.config import ConfigError
    from dpmem.methods import validate
    with pytest.raises(ConfigError) as refused:
        validate(config("method=dp-adam", override))
    assert refused.value.key == key


@pytest.mark.parametrize("overrides, want", [([], 32), (["train.physical_batch_size=8"], 8),
                                             (["train.physical_batch_size=8", "train.eval_batch_size=100"], 100)])
def test_evaluation_runs_at_the_physical_batch_size_unless_told(tmp_path, monkeypatch, overrides, want):
    """Issue 35: a run sized by its training peak must not run out of memory at its final evaluation, so evaluation
    batches default to the physical batch size (the logical one when there is no physical one)."""
    import dpmem.engine.trainer as trainer
    real, seen = trainer.evaluate, []

    def recording(parts, batch_size):
        seen.append(batch_size)
        return real(parts, batch_size)
    monkeypatch.setattr(trainer, "evaluate", recording)
    run_training(config("method=adam", "train.steps=1", "train.device=cpu", *overrides), tmp_path)
    assert seen == [want]
