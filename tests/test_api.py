"""The Python API keeps ε as `dpmem train` does: the method's own accountant, one loss per sample, and one clear
error for a frozen model, a budget written as the CLI takes it, a sampling rate above 1 and an unknown option."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmem import api
from dpmem.config import ConfigError
from dpmem.privacy import rc_envelope as rc
from dpmem.privacy.randomness import seed_key
from test_docs import example


def test_the_example_calibrates_and_spends_dp_sgd_rc_by_its_own_accountant():
    """`examples/private_loop.py --method dp-sgd-rc` took PLD's σ and reported PLD's ε (7.99 where rc's accountant
    gives 10.6-11.1): now its σ is rc's for ε = 8, and its ε is rc's own epsilon (dpmem.privacy.rc_envelope) at that
    σ."""
    steps, q = 5, 64 / 1500
    out = example().train(steps=steps, method="dp-sgd-rc", seed=3)
    cfg = api.method_config("dp-sgd-rc")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
    account = api.accounting(cfg, model)
    assert account["accountant"] == "rc" and account["k"] == cfg.k
    spent = rc.rc_epsilon(out["sigma"], 1e-5, q, steps, account["k"], account["d"], account["estimator"], 1e-3, None)
    assert out["epsilon"] == pytest.approx(spent, rel=1e-9) and 7.9 < spent <= 8.0 * 1.001
    assert out["sigma"] > api.calibrate_sigma(8.0, 1e-5, q, steps)  # more noise than PLD's σ for the same ε


def small():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    batch = {"x": torch.randn(5, 4), "y": torch.tensor([0, 1, 2, 0, 1])}
    return model, batch


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_loss_that_is_not_one_value_per_sample_is_refused_naming_its_shape(reduction):
    """A mean (or sum) over the batch would be clipped as one sample's loss: one record could then move the
    clipped sum by more than C (1.89 C seen)."""
    model, batch = small()
    noise = api.GaussianMechanism(1.0, 1.0, 5.0, api.Draws(seed_key(0), "noise"))
    loss = lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction=reduction)  # noqa: E731
    for plan in ("bk", "ghost"):
        with api.Privatizer(model, noise, api.ClippingPlan.of(plan)) as privatize:
            with pytest.raises(ValueError, match=r"returned shape \(\) for a micro-batch of 5: .* shape \(5,\)"):
                privatize.gradient([batch], loss, {p: p.shape for p in privatize.params})


def test_a_frozen_model_a_budget_in_words_a_rate_above_one_and_an_unknown_option_are_one_clear_error():
    model, _ = small()
    for p in model.parameters():
        p.requires_grad_(False)
    noise = api.GaussianMechanism(1.0, 1.0, 5.0, api.Draws(seed_key(0), "noise"))
    with pytest.raises(ValueError, match="no trainable parameter"):
        api.Privatizer(model, noise)
    with pytest.raises(ValueError, match="no trainable parameter"):
        api.build_method(api.method_config("dp-adam"), model, 0.1, noise)
    with pytest.raises(ValueError, match=r"sample_rate=2: a probability"):
        next(api.poisson_batches(10, 2, 1, api.Draws(seed_key(0), "batches")))
    with pytest.raises(ConfigError, match="method: unknown option 'bogus'; allowed: .*dp-adam"):
        api.config("method=bogus")
    cfg = api.config("model=roberta-tiny", "data=synthetic", "data.seq_len=8", "method=dp-adam")
    words = api.largest_batch(cfg, "1.5MiB", limit=16)[0]  # as memory.budget takes it
    assert 0 < words < 16 and words == api.largest_batch(cfg, int(1.5 * 2**20), limit=16)[0]
