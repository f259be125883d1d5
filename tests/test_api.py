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
    gives 10.6-11.1): now its σ is rc's for the ε asked, and its ε is rc's own epsilon (dpmem.privacy.rc_envelope) at
    that σ. Asked ε = 1 (the example's default is 8): the rc accountant calibrates it in a quarter of the time."""
    steps, q = 5, 64 / 1500
    out = example().train(steps=steps, method="dp-sgd-rc", seed=3, epsilon=1.0)
    cfg = api.method_config("dp-sgd-rc")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
    account = api.accounting(cfg, model)
    assert account["accountant"] == "rc" and account["k"] == cfg.k
    spent = rc.rc_epsilon(out["sigma"], 1e-5, q, steps, account["k"], account["d"], account["estimator"], 1e-3, None)
    assert out["epsilon"] == pytest.approx(spent, rel=1e-9) and 0.9875 < spent <= 1.0 * 1.001
    assert out["sigma"] > api.calibrate_sigma(1.0, 1e-5, q, steps)  # more noise than PLD's σ for the same ε


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


@pytest.mark.long
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


def test_the_docs_whole_method_loop_spends_dp_sgd_rc_by_the_accountant_dpmem_train_uses():
    """docs/api.md's build_method loop, with dp-sgd-rc: it took PLD's σ and printed PLD's ε (8 where rc's
    accountant gives 10.6 for the example's 100 steps). Now σ and ε are those `dpmem train` calibrates for the same
    config and model (its loss outside ε, privacy.train_loss=exact, as the API's mechanism releases none). At ε = 1,
    which the rc accountant calibrates in a fraction of its time at 8."""
    import re
    from pathlib import Path

    from dpmem.engine.assemble import envelope
    from dpmem.methods import method_class
    from dpmem.privacy.calibrate import calibrate

    docs = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", docs, re.S) if "build_method(cfg" in b)
    assert 'method_config("grape", rank=8, ' in block
    block = block.replace('"grape", rank=8, ', '"dp-sgd-rc", ')
    n, steps, batch = 200, 3, 16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 40), nn.Tanh(), nn.Linear(40, 3))  # sides >= k = 32 probes
    x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
    printed = []
    ns = {**{name: getattr(api, name) for name in api.__all__}, "print": printed.append, "model": model, "x": x,
          "y": y, "n": n, "q": batch / n, "steps": steps, "epsilon": 1.0, "delta": 1e-5, "lr": 0.1,
          "max_grad_norm": 1.0, "key": api.key_of(0),
          "per_sample_loss": lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none")}
    exec(block, ns)
    cfg = api.config("method=dp-sgd-rc", "privacy=eps1", "privacy.train_loss=exact", f"train.batch_size={batch}",
                     f"train.steps={steps}")
    trained = calibrate(cfg, method_class("dp-sgd-rc").spec, n, steps, "poisson", torch.device("cpu"),
                        envelope(cfg, model))
    assert trained.event.accountant == "rc" and ns["sigma"] == pytest.approx(trained.sigma, rel=1e-9)
    assert printed == [pytest.approx(trained.epsilon(steps), rel=1e-9)] and 0.9875 < printed[0] <= 1.0 * 1.001


def test_a_loss_mixing_samples_is_named_in_the_loss_contract_and_refused_before_a_release():
    """A batch sum fails the shape check; `per_sample + per_sample.mean()` has shape (B,) and passes it, and the
    attribution proof refuses it, naming the loss, before any noise is drawn."""
    from dpmem.methods.privatize import Privatizer

    assert "sample i alone" in Privatizer.gradient.__doc__
    model, batch = small()
    noise = api.GaussianMechanism(1.0, 1.0, 5.0, api.Draws(seed_key(0), "noise"))
    with api.Privatizer(model, noise, api.ClippingPlan.of("bk")) as privatize:
        with pytest.raises(ValueError, match="each depending on its own sample alone"):
            privatize.gradient([batch], lambda m, b: m(b["x"]).sum(), {p: p.shape for p in privatize.params})

        def mixed(m, b):
            losses = F.cross_entropy(m(b["x"]), b["y"], reduction="none")
            return losses + losses.mean()
        with pytest.raises(RuntimeError, match="the loss function mixes samples"):
            privatize.gradient([batch], mixed, {p: p.shape for p in privatize.params})
    assert noise.state.noise.count == 0


@pytest.mark.parametrize("field, args", [("sigma", (-1.0, 1.0, 5.0)), ("sigma", (float("nan"), 1.0, 5.0)),
                                         ("max_grad_norm", (1.0, 0.0, 5.0)), ("max_grad_norm", (1.0, -2.0, 5.0)),
                                         ("expected_batch_size", (1.0, 1.0, 0.0)), ("sigma", ("1", 1.0, 5.0))])
def test_a_mechanism_with_a_negative_sigma_or_a_clipping_norm_of_zero_is_refused_naming_the_field(field, args):
    with pytest.raises(ValueError, match=rf"GaussianMechanism: {field}=.*: allowed a number"):
        api.GaussianMechanism(*args, None)
    assert api.GaussianMechanism(0.0, float("inf"), 5.0, None).sigma == 0  # no noise, no clipping: privacy=none's


def test_wrong_types_in_the_api_are_one_clear_error_naming_what_is_wrong():
    with pytest.raises(TypeError, match=r"config: override 123 \(int\): allowed strings"):
        api.config(123)
    for call in (api.plan, lambda cfg: api.largest_batch(cfg, "1GB")):
        with pytest.raises(TypeError, match=r"cfg is dict: allowed a run's config, dpmem.api.config"):
            call({"model": "vit-tiny"})
    with pytest.raises(TypeError, match=r"epsilon='8' \(str\): allowed a number"):
        api.calibrate_sigma("8", 1e-5, 0.01, 100)
    with pytest.raises(TypeError, match=r"steps=1.5 \(float\): allowed an integer"):
        api.epsilon_spent(1.0, 1e-5, 0.01, 1.5)
    model, batch = small()
    noise = api.GaussianMechanism(1.0, 1.0, 5.0, api.Draws(seed_key(0), "noise"))
    with pytest.raises(TypeError, match=r"dp-adam: lr='0.1' \(str\): allowed a number"):
        api.build_method(api.method_config("dp-adam"), model, "0.1", noise)
    loss = lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none")  # noqa: E731
    privatize = api.Privatizer(model, noise)
    privatize.close()
    with pytest.raises(RuntimeError, match=r"Privatizer.gradient after close\(\)"):
        privatize.gradient([batch], loss, {p: p.shape for p in privatize.params})
