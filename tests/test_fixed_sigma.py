"""A fixed noise multiplier (privacy.noise_multiplier=σ) instead of a budget: the run spends the ε its σ, rate and
steps give, accounted, ledgered and reported as a calibrated run's. ε is checked against dp-accounting's PLD of the
Poisson-subsampled Gaussian built here; the loss release's noise (c·σ on the loss sum) joined to the gradient's as
one Gaussian is computed here from its definition."""

import json
import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from dpmem.engine.folder import FolderRefused
from dpmem.engine.trainer import run_training
from dpmem.methods import METHODS
from helpers import config, dies_at

TINY = ["method=dp-adam", "train.device=cpu", "model=vit-tiny", "data.image_size=8", "train.batch_size=64",
        "train.steps=4", "logging.memory_steps=0", "logging.progress=false"]


def pld_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4).compose(event).get_epsilon(delta)


def joined(sigma: float, c: float) -> float:
    """The gradient's Gaussian (sensitivity C, std σC) and the loss's (sensitivity L, std cσL) as one: their
    precisions add, 1/σ² + 1/(cσ)²."""
    return (sigma ** -2 + (c * sigma) ** -2) ** -0.5


def test_a_fixed_sigma_spends_the_epsilon_dp_accounting_gives(cli, tmp_path):
    r = cli("train", "privacy.noise_multiplier=1.0", *TINY, "hydra.run.dir=run")
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["status"] == "ok" and s["sigma"] == 1.0 and s["noise_multiplier_fixed"] == 1.0
    assert s["sample_rate"] == pytest.approx(64 / s["n_train"], rel=1e-12)
    assert s["sigma_accounted"] == pytest.approx(joined(1.0, 10.0), rel=1e-12)  # privacy.loss_noise's default
    want = pld_epsilon(s["sigma_accounted"], s["sample_rate"], 4, s["delta"])
    assert want <= s["epsilon_spent"] <= want * 1.002  # dpmem's coarser PLD is the pessimistic side
    assert s["epsilon_target"] == s["epsilon_spent"]  # all the planned steps ran
    assert "epsilon spent / planned" in r.stdout and "sigma 1 fixed" in r.stdout
    config_yaml = (tmp_path / "run" / "config.yaml").read_text()
    assert "noise_multiplier: 1.0" in config_yaml and "epsilon: null" in config_yaml
    # the ledger's lines are those of any run: σ, q, steps and ε
    end = [json.loads(x) for x in (tmp_path / "run" / "privacy.jsonl").read_text().splitlines()][-1]
    assert end["sigma_accounted"] == s["sigma_accounted"] and end["epsilon"] == s["epsilon_spent"]


@pytest.mark.parametrize("overrides,said", [
    (["privacy.noise_multiplier=1.0", "privacy.epsilon=8"], "privacy.noise_multiplier: 1 fixes σ, and "
                                                            "privacy.epsilon=8 asks for σ calibrated to it"),
    (["privacy=eps2", "privacy.noise_multiplier=1.0"], "privacy.epsilon=2 asks"),
    (["privacy.noise_multiplier=0"], "privacy.noise_multiplier: 0.0 must be a finite number > 0"),
    (["privacy.noise_multiplier=-1"], "privacy.noise_multiplier: -1.0 must be"),
    (["privacy.noise_multiplier=inf"], "privacy.noise_multiplier: inf must be"),
])
def test_a_fixed_sigma_beside_a_budget_or_out_of_range_is_refused_in_one_line(cli, tmp_path, overrides, said):
    r = cli("train", *overrides, *TINY, "hydra.run.dir=run")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("dpmem: error: ") and said in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_a_fixed_sigma_with_a_non_private_method_is_said_to_do_nothing_and_a_search_refuses_it(cli, tmp_path):
    r = cli("train", "method=adam", "privacy.noise_multiplier=1.0", *TINY[1:], "train.steps=1", "hydra.run.dir=run")
    assert r.returncode == 0 and "privacy.noise_multiplier=1 has no effect: adam is not private" in r.stderr
    r = cli("train", "-m", "hydra/sweeper=private", "privacy.noise_multiplier=1.0",
            "train.lr=tag(log, interval(1e-3, 1e-1))", *TINY, "hydra.sweep.dir=s")
    assert r.returncode == 2 and r.stderr.startswith("dpmem: error: privacy.noise_multiplier: 1: a private search "
                                                     "calibrates its trials' noise"), r.stderr


def test_a_sweep_over_sigma_is_composed_and_no_edit_of_its_files_lowers_it(cli, tmp_path):
    r = cli("train", "-m", "privacy.noise_multiplier=0.8,1.6", *TINY, "hydra.sweep.dir=sweep")
    assert r.returncode == 0, r.stderr
    runs = sorted(p for p in (tmp_path / "sweep").iterdir() if (p / "summary.json").is_file())
    summaries = [json.loads((p / "summary.json").read_text()) for p in runs]
    assert [s["noise_multiplier_fixed"] for s in summaries] == [0.8, 1.6]
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    for s in summaries:
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            s["sample_rate"], dp_accounting.GaussianDpEvent(joined(s["sigma"], 10.0))), s["steps_done"]))
    want = acc.get_epsilon(summaries[0]["delta"])

    def reported() -> tuple[float, str]:
        out = cli("report", "sweep")
        assert out.returncode == 0, out.stderr
        line = next(x for x in out.stdout.splitlines() if x.startswith("- digits:"))
        return float(line.split("ε = ")[1].split(" ")[0]), out.stdout

    eps, text = reported()
    assert want * 0.999 <= eps <= want * 1.01, (eps, want)
    assert "(σ 0.8)" in text and "(σ 1.6)" in text  # each row names its σ beside its ε
    # a larger σ (and a smaller ε) written into one of a run's files, each in turn: the report composes no less
    low = runs[0]
    kept = {name: (low / name).read_text() for name in ("config.yaml", "privacy.jsonl", "summary.json")}

    def ledger(text: str) -> str:
        lines = [json.loads(x) for x in text.splitlines()]
        for line in lines:
            line.update({k: 50.0 for k in ("sigma", "sigma_accounted") if line.get(k)})
            line.update({"epsilon": 0.01} if line.get("epsilon") is not None else {})
        return "".join(json.dumps(x) + "\n" for x in lines)

    edits = {"config.yaml": lambda text: text.replace("noise_multiplier: 0.8", "noise_multiplier: 50.0"),
             "privacy.jsonl": ledger,
             "summary.json": lambda text: json.dumps(json.loads(text) | {
                 "sigma": 50.0, "sigma_accounted": 50.0, "noise_multiplier_fixed": 50.0, "epsilon_spent": 0.01,
                 "epsilon_target": 0.01})}
    for name, edit in edits.items():
        (low / name).write_text(edit(kept[name]))
        assert (low / name).read_text() != kept[name]
        edited, _ = reported()
        assert edited >= eps * 0.999, (name, edited, eps)
        (low / name).write_text(kept[name])


def test_a_resume_at_another_sigma_is_refused_and_an_overwrite_composes_both_attempts(cli, monkeypatch, tmp_path):
    """A run dies at step 3 with σ 0.6; the same folder at σ 3: not resumed (another configuration); with
    train.resume=false train.overwrite=true a fresh attempt, and the report composes the abandoned attempt's releases at σ 0.6 too."""
    run = tmp_path / "run"
    dies_at(monkeypatch, METHODS["dp-adam"], 3)
    with pytest.raises(RuntimeError):
        run_training(config(*TINY, "privacy.noise_multiplier=0.6", "train.checkpoint_every=1"), run)
    monkeypatch.undo()
    with pytest.raises(FolderRefused):
        run_training(config(*TINY, "privacy.noise_multiplier=3.0", "train.checkpoint_every=1"), run)
    run_training(config(*TINY, "privacy.noise_multiplier=3.0", "train.resume=false", "train.overwrite=true"), run)
    r = cli("report", str(run))
    assert r.returncode == 0, r.stderr
    composed = float(next(x for x in r.stdout.splitlines() if x.startswith("- digits:")).split("ε = ")[1].split()[0])
    s = json.loads((run / "summary.json").read_text())
    alone = pld_epsilon(joined(3.0, 10.0), s["sample_rate"], 4, s["delta"])
    abandoned = pld_epsilon(joined(0.6, 10.0), s["sample_rate"], 2, s["delta"])  # it ledgered 2 steps at least
    assert composed > max(alone, abandoned) and math.isfinite(composed), (composed, alone, abandoned)


@pytest.mark.parametrize("method", ["adam", "dp-adam"])
def test_privacy_none_still_runs_with_neither_a_budget_nor_a_sigma(cli, tmp_path, method):
    """Neither privacy.epsilon nor privacy.noise_multiplier: a non-private run (its warning about a budget that
    buys nothing was built from a σ that is not there, and failed)."""
    r = cli("train", f"method={method}", "privacy=none", *TINY[1:], "train.steps=1", "hydra.run.dir=run")
    assert r.returncode == 0 and "has no effect" not in r.stderr, r.stderr
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["status"] == "ok" and s["epsilon_target"] is None and s["noise_multiplier_fixed"] is None
