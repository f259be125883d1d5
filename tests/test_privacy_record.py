"""The privacy unit as one value (`dpmem.privacy.record.PrivacyUnit`): what a run's config asks for is what its
summary records, read back the same, and a summary that lost its sampling reads as the weaker guarantee."""

import pytest
from helpers import config

from dpmem.engine.trainer import run_training
from dpmem.privacy.record import PrivacyUnit


@pytest.mark.parametrize("overrides, want", [
    ((), PrivacyUnit()),
    (("privacy.unit=user", "privacy.records_per_user=3", "privacy.user_sampling=records"),
     PrivacyUnit(True, "records", 3)),
    (("privacy.unit=user", "privacy.records_per_user=2", "privacy.user_sampling=users"),
     PrivacyUnit(True, "users", 2)),
])
def test_the_unit_a_config_asks_for_is_the_one_its_summary_records(tmp_path, overrides, want):
    cfg = config("data.users=100", "train.steps=1", "train.device=cpu", "privacy.epsilon=null",
                 "privacy.noise_multiplier=1.0", *overrides)  # σ given: no calibration (ELS's takes seconds)
    assert PrivacyUnit.of(cfg.privacy) == want
    summary = run_training(cfg, tmp_path)
    assert summary["status"] == "ok" and summary["unit"] == want.name  # the summary's own word for it
    assert PrivacyUnit.in_summary(summary) == want


def test_a_summary_without_its_sampling_reads_as_els_whose_search_has_no_user_level_epsilon():
    assert PrivacyUnit.in_summary({"unit": "user", "records_per_user": 4}).els
    assert not PrivacyUnit.in_summary({"unit": "record", "user_sampling": "users"}).user


def test_an_events_epsilon_is_dp_accountings_composition_built_here():
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from dpmem.privacy.accounting import PLD_DISCRETIZATION
    from dpmem.privacy.accounting import Event
    event = Event(sigma=1.1, delta=1e-5, sample_rate=0.02, dataset_size=5000)
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    oracle.compose(dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1)), 300)
    assert event.epsilon(300) == pytest.approx(oracle.get_epsilon(1e-5), rel=1e-6)


def test_an_event_holds_epsilon_spents_keywords():
    from dpmem.privacy.accounting import Event
    plain = {"accountant": "pld", "neighbouring": "replace_one", "sampling": "cyclic", "dataset_size": 1000,
             "loss_noise": 2.0, "groups": 4, "noise": ("bandmf", 4, 100), "user_records": None}
    rc = {**plain, "accountant": "rc", "k": 8, "d": 2048.0, "estimator": "hutchpp"}
    for terms in (plain, rc):
        event = Event.of(1.0, 1e-5, 0.1, terms)
        held = {k: getattr(event, k) for k in plain} | dict(zip(("k", "d", "estimator"), event.rc or ()))
        assert held == terms and (event.sigma, event.delta, event.sample_rate) == (1.0, 1e-5, 0.1)


def test_a_ledger_line_gives_back_the_epsilon_of_its_event_as_dp_accounting_composes_it():
    """Event.line is what privacy.jsonl records, and line_epsilon reads it back through Event.from_line: the joint
    multiplier of the gradient's and the loss's releases (the loss's noise loss_noise·σ: one Gaussian of
    (σ⁻² + (loss_noise·σ)⁻²)^(-1/2), composed here by dp-accounting), and the correlated strategy as JSON gives it
    back (a list)."""
    import json

    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from dpmem.privacy.accounting import PLD_DISCRETIZATION
    from dpmem.privacy.accounting import Event
    from dpmem.privacy.record import line_epsilon
    sigma, loss = 1.1, 2.0
    event = Event(sigma=sigma, delta=1e-5, sample_rate=0.02, dataset_size=5000, loss_noise=loss)
    line = json.loads(json.dumps({**event.line(), "steps_done": 300}))
    joint = (sigma ** -2 + (loss * sigma) ** -2) ** -0.5
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    oracle.compose(dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(joint)), 300)
    assert line["sigma_accounted"] == pytest.approx(joint, rel=1e-12)
    assert line_epsilon(line) == pytest.approx(oracle.get_epsilon(1e-5), rel=1e-6) == pytest.approx(event.epsilon(300))
    banded = Event(sigma=1.1, delta=1e-5, sample_rate=0.05, sampling="cyclic", dataset_size=1000, groups=4,
                   noise=("bandmf", 2, 40))
    line = json.loads(json.dumps({**banded.line(), "steps_done": 40}))
    assert line["strategy"] == ["bandmf", 2, 40] and Event.from_line(line) == banded
    assert line_epsilon(line) == banded.epsilon(40)
    # what a line cannot say is no ε: rc's envelope, a field gone, a σ that is not a number
    assert line_epsilon({**line, "accountant": "rc"}) is None
    assert line_epsilon({k: v for k, v in line.items() if k != "delta"}) is None
    assert line_epsilon({**line, "sigma_accounted": "many"}) is None
    assert Event(sigma=1.0, delta=None, sample_rate=0.1).line()["accountant"] is None  # nothing accounted


def _pld_epsilon(event, steps: int, delta: float = 1e-5) -> float:
    """ε of a Poisson-subsampled Gaussian (`event`'s σ and q) over `steps` steps, composed here by dp-accounting."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from dpmem.privacy.accounting import PLD_DISCRETIZATION
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    oracle.compose(dp_accounting.PoissonSampledDpEvent(event.sample_rate, dp_accounting.GaussianDpEvent(event.sigma)),
                   steps)
    return oracle.get_epsilon(delta)


def test_composed_events_are_dp_accountings_composition_of_their_gaussians_built_here():
    """composed_epsilon takes (Event, steps) pairs: two runs on the same data, one with its loss released beside its
    gradient (one Gaussian of the joint multiplier), composed here by dp-accounting's PLD accountant."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from dpmem.privacy.accounting import PLD_DISCRETIZATION, composed_epsilon
    from dpmem.privacy.accounting import Event
    a, b = Event(1.2, 1e-5, 0.02), Event(0.9, 1e-5, 0.05, loss_noise=3.0)
    joint = (0.9 ** -2 + (3.0 * 0.9) ** -2) ** -0.5
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    def steps(q: float, sigma: float, count: int):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)

    oracle.compose(dp_accounting.ComposedDpEvent([steps(0.02, 1.2, 200), steps(0.05, joint, 80)]))
    assert composed_epsilon([(a, 200), (b, 80)], 1e-5) == pytest.approx(oracle.get_epsilon(1e-5), rel=1e-6)
    assert composed_epsilon([(a, 200), (Event(0.0, 1e-5, 0.1), 5)], 1e-5) == float("inf")  # a run without noise


def test_of_two_events_the_costlier_is_the_one_dp_accounting_says_spends_more():
    """What `dpmem report` takes where a ledger and a config.yaml disagree: the event of the larger ε (each composed
    here by dp-accounting), and never one that cannot be accounted."""
    from dataclasses import replace

    from dpmem.privacy.accounting import Event
    less = Event(1.5, 1e-5, 0.02)
    for more in (replace(less, sigma=1.2), replace(less, sample_rate=0.03)):
        assert _pld_epsilon(more, 100) > _pld_epsilon(less, 100)
        for one, other in ((less, more), (more, less)):
            event, epsilon = one.costlier(other, 100)
            assert event == more and epsilon == pytest.approx(_pld_epsilon(more, 100), rel=1e-6)
    broken = replace(less, sampling="cyclic", noise="bandmf")  # a strategy that is not (name, bands, horizon)
    assert less.costlier(broken, 100)[0] is less
    assert less.costlier(replace(less, sample_rate="0.5"), 100)[0] is less  # a rate that is not a number


def test_calibrating_an_event_gives_the_least_sigma_dp_accounting_says_meets_epsilon():
    """Event.calibrated: its σ meets ε by dp-accounting's composition built here, and σ less by a little more than
    the tolerance does not; the event's own σ is not read."""
    from dpmem.privacy.accounting import Event
    for start in (0.0, 5.0):
        event = Event(start, 1e-5, 0.02).calibrated(2.0, 300)
        assert _pld_epsilon(event, 300) <= 2.0 < _pld_epsilon(Event(event.sigma - 2e-3, 1e-5, 0.02), 300)
