"""What a private run releases (issue 42): the training loss in ε (clipped, noised, composed with the gradient),
outside it under a key that says so, or not at all; no exact batch sizes; no checkpoint secrets left behind."""

import dataclasses
import json
import math

import dp_accounting
import pytest
import torch
from dp_accounting import pld
from scipy.optimize import brentq

from dpmem.config import ConfigError
from dpmem.engine.trainer import run_training
from dpmem.methods import validate
from dpmem.methods.privatize import Privatizer
from dpmem.privacy import calibrate_sigma, epsilon_spent
from dpmem.privacy.accounting import PLD_DISCRETIZATION
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, seed_key
from dpmem.privacy.strategies import make_strategy
from helpers import Layers, config, layers_batch, layers_loss
from tests.test_privacy import analytic_gaussian_delta


def test_the_gradient_and_the_loss_on_one_batch_are_one_gaussian():
    """One step, no subsampling: releasing the clipped sum (sensitivity C, noise σC) and the clipped loss sum
    (sensitivity L, noise cσL) is a Gaussian with sensitivity √(1/σ² + 1/(cσ)²) in units of its noise (Balle & Wang's
    closed form of the pair's privacy loss)."""
    sigma, c, delta = 2.0, 1.5, 1e-5
    mu = math.sqrt(sigma ** -2 + (c * sigma) ** -2)
    exact = brentq(lambda e: analytic_gaussian_delta(e, 1.0, mu) - delta, 1e-6, 50)
    got = epsilon_spent(sigma, delta, 1.0, 1, "pld", loss_noise=c)
    assert exact - 1e-9 <= got <= exact + 2e-3
    assert got > epsilon_spent(sigma, delta, 1.0, 1, "pld")  # the loss costs something


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_sigma_calibrated_with_the_loss_spends_the_target(accountant):
    q, steps, delta, c = 0.05, 200, 1e-5, 10.0
    sigma = calibrate_sigma(4.0, delta, q, steps, accountant, loss_noise=c)
    assert sigma > calibrate_sigma(4.0, delta, q, steps, accountant)  # the gradient gets a little more noise
    joint = (sigma ** -2 + (c * sigma) ** -2) ** -0.5
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(joint)), steps)
    acc = (pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION) if accountant == "pld"
           else dp_accounting.rdp.RdpAccountant())
    assert 4.0 * 0.99 <= acc.compose(event).get_epsilon(delta) <= 4.0 * 1.0005


def test_the_rc_accountant_adds_the_loss_as_a_second_coordinate():
    """Randomized clipping's random sensitivity A becomes √(A² + 1/c²): with one point mass at A = 1 (k huge) the
    rc accountant is the Gaussian of the other tests; in general more loss noise costs less."""
    args = dict(sigma=1.0, delta=1e-5, sample_rate=0.05, steps=20, accountant="rc", k=32, d=4)
    plain, cheap, dear = (epsilon_spent(**args, loss_noise=c) for c in (None, 100.0, 2.0))
    assert plain < cheap < dear and cheap == pytest.approx(plain, rel=1e-3)


def test_the_released_loss_is_the_clipped_sum_and_one_draw_of_its_key():
    """Σᵢ min(max(ℓᵢ, 0), L) over the batch (ℓᵢ from a loop over the samples) plus loss_sigma·L·z, z the first
    draw of the noise key's "loss" purpose; the gradient's noise draws are unchanged by it."""
    torch.manual_seed(0)
    model, batch = Layers().double(), layers_batch()
    L, loss_sigma = 17.45, 0.3
    with torch.no_grad():
        per_sample = torch.cat([layers_loss(model, {k: v[i:i + 1] for k, v in batch.items()}) for i in range(5)])
    assert (per_sample > L).any() and (per_sample < L).any()  # the bound clips some
    noise = GaussianMechanism(1.0, 0.5, 5.0, Draws(seed_key(7), "noise"), loss_bound=L, loss_sigma=loss_sigma)
    with Privatizer(model, noise) as privatize:
        released = privatize.gradient([batch], layers_loss, {p: p.shape for p in privatize.params}).loss_sum
    z = Draws(seed_key(7), "loss").randn(dtype=released.dtype)
    torch.testing.assert_close(released, per_sample.clamp(0, L).sum() + loss_sigma * L * z)


def summary(folder) -> dict:
    return json.loads((folder / "summary.json").read_text())


def records(folder, name="metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (folder / name).read_text().splitlines()]


@pytest.mark.parametrize("release", ["private", "exact", "none"])
def test_a_private_run_releases_its_loss_as_it_was_asked(tmp_path, release):
    run_training(config("method=dp-adam", "train.device=cpu", f"privacy.train_loss={release}"), tmp_path)
    s, logged = summary(tmp_path), [r for r in records(tmp_path) if not r.get("final")]
    keys = {k for r in logged for k in r}
    if release == "private":
        assert "loss" in keys and s["train_loss"] is not None and s["loss_sigma"] == pytest.approx(10 * s["sigma"])
    elif release == "exact":
        assert "loss" not in keys and "loss_outside_epsilon" in keys and s["train_loss"] is None
        assert s["train_loss_outside_epsilon"] is not None
        assert any("train_loss_outside_epsilon" in k for k in s["released_outside_epsilon"])
    else:
        assert not any("loss" in k for k in keys) and s["train_loss"] is None
    # the batches' sizes are counts of private data: only the expected q·n per step is recorded
    assert s["samples_seen"] is None and s["samples_expected"] == pytest.approx(5 * 32)
    assert not any("samples_seen" in r for r in records(tmp_path, "privacy.jsonl"))


def test_a_search_by_training_loss_needs_the_loss_in_epsilon():
    with pytest.raises(ConfigError, match="train.objective"):
        validate(config("method=dp-adam", "train.objective=train_loss", "privacy.train_loss=exact"))
    validate(config("method=dp-adam", "train.objective=train_loss"))  # private: in ε
    validate(config("method=adam", "train.objective=train_loss", "privacy.train_loss=none"))  # nothing to protect


def test_no_checkpoint_tmp_survives_a_run_that_ends(tmp_path):
    """A save killed before its rename leaves checkpoint.pt.tmp (weights, the noise's and the sampler's keys): a
    run started over in the folder without checkpoints removes it, and so does any run that ends."""
    run_training(config("method=dp-adam", "train.device=cpu", "train.steps=2"), tmp_path)
    (tmp_path / "checkpoint.pt.tmp").write_bytes(b"the killed first save")
    run_training(config("method=dp-adam", "train.device=cpu", "train.steps=2", "train.overwrite=true",
                        "train.checkpoint_every=0"), tmp_path)
    assert not (tmp_path / "checkpoint.pt.tmp").exists() and summary(tmp_path)["status"] == "ok"


def test_a_derived_mechanism_continues_its_bases_state():
    """Issue 76: one state per run. A mechanism derived by `dataclasses.replace` (the method's with a subspace's
    observer, the audit's broken ones, the planner's strategy) counts, keys and accounts with its base's state, so
    the trainer's mechanism and the method's release as one; a changed strategy is drawn afresh from the same key,
    before the first release only."""
    base = GaussianMechanism(1.0, 1.0, 4.0, Draws(seed_key(5), "noise"))
    derived = dataclasses.replace(base, observers=("seen",))
    assert derived.state is base.state and derived.observers == ("seen",)
    derived.release({"w": torch.zeros(3)})
    assert base.releases == 1 and base.state.noise.count == 1  # the base sees its derived one's release
    fresh = GaussianMechanism(1.0, 1.0, 4.0, Draws(seed_key(5), "noise"))
    banded = dataclasses.replace(fresh, strategy=make_strategy("bandmf", 2, 4))
    assert banded.state is fresh.state and banded.correlated.key == seed_key(5)
    first = banded.release({"w": torch.zeros(3)})["w"].clone()
    oracle = GaussianMechanism(1.0, 1.0, 4.0, Draws(seed_key(5), "noise"), strategy=make_strategy("bandmf", 2, 4))
    assert torch.equal(first, oracle.release({"w": torch.zeros(3)})["w"])
    with pytest.raises(RuntimeError, match="changed after it released"):
        dataclasses.replace(banded, strategy=None)
    with pytest.raises(ValueError, match="draws= and state= both given"):
        GaussianMechanism(1.0, 1.0, 4.0, Draws(seed_key(5), "noise"), state=base.state)
