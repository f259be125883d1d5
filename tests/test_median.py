"""Li et al. 2022 Fig. 1's generalized geometric median (data=median, model=median): the per-sample loss and its
per-sample gradients against their closed forms, min F against scipy's solver, the generated data's law, and a
dp-sgd sweep through `dpmem train` that `dpmem report` draws as the paper's figure."""

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from scipy import optimize

from dpmem.composition import CONF_DIR
from dpmem.data import build_data
from dpmem.data.median import diagonal, minimum, objective
from dpmem.models import build_model
from dpmem.persample import Taps


def config(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=["model=median", "data=median", *overrides])


@pytest.mark.parametrize("A", ["const", "sqr", "linear"])
def test_loss_and_per_sample_gradients_equal_their_closed_forms(A):
    cfg = config(f"data.A={A}", "data.dimension=7", "data.d_min=3", "data.alpha=0.3", "data.n_train=16",
                 "data.n_test=4")
    data = build_data(cfg.data, cfg.model)
    model = build_model(cfg.model, data)
    torch.manual_seed(0)
    with torch.no_grad():
        model.beta.copy_(torch.randn(7))
    x = data.train["x"][:6].double()
    beta, a = model.beta.detach().double(), diagonal(A, 7)
    full = torch.cat([x, torch.zeros(6, 4, dtype=torch.float64)], 1)  # the examples, their tail written out
    dist = ((beta - full) ** 2 * a).sum(1).sqrt()
    want_loss = dist + 0.3 / 2 * beta.pow(2).sum()
    want_grads = a * (beta - full) / dist[:, None] + 0.3 * beta  # ∇fᵢ = A(β − xᵢ)/‖β − xᵢ‖_A + αβ
    taps = Taps(model)
    with taps.recording(taps.zero(), 6) as tape:
        losses = data.per_sample_loss(model, {"x": data.train["x"][:6]})
    kept, _ = taps.per_sample(tape, losses.sum())
    torch.testing.assert_close(losses.double(), want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kept[model.beta].double(), want_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("A,alpha", [("const", 0.0), ("sqr", 0.05), ("linear", 0.5)])
def test_min_f_equals_a_direct_solver(A, alpha):
    """Weiszfeld's fixed point against scipy's BFGS on the whole d-dimensional problem (tail included)."""
    rng = np.random.default_rng(1)
    d, m, n = 8, 3, 200
    x = torch.as_tensor(rng.normal(1.0, 1.0, (n, m)))
    a = diagonal(A, d)
    beta, low = minimum(x, a, alpha)
    full = np.concatenate([x.numpy(), np.zeros((n, d - m))], 1)

    def F(b):
        return np.mean(np.sqrt(((b - full) ** 2 * a.numpy()).sum(1))) + alpha / 2 * (b ** 2).sum()
    solved = optimize.minimize(F, np.full(d, 0.3), method="BFGS", options={"gtol": 1e-12})
    assert low == pytest.approx(solved.fun, abs=1e-9)
    assert low <= solved.fun + 1e-12  # the fixed point is no worse than the solver
    np.testing.assert_allclose(beta.numpy(), solved.x, atol=1e-4)
    assert low == pytest.approx(objective(beta, x, a, alpha), abs=0)
    assert torch.all(beta[m:] == 0)  # beyond d_min the minimiser is 0


def test_the_generated_data_follows_the_papers_law():
    cfg = config("data.dimension=50", "data.n_train=10000", "data.n_test=10000")
    data = build_data(cfg.data, cfg.model)
    x, t = data.train["x"].double(), data.test["x"].double()
    assert x.shape == t.shape == (10000, 10)  # only the first d_min coordinates are stored: the rest are 0
    assert data.input_shape == (50,) and not torch.equal(x, t)  # two independent draws
    se = 1 / 10000 ** 0.5  # N(1, 1): the mean of 10⁴ draws is within 4 standard errors of 1, per coordinate
    assert torch.all((x.mean(0) - 1).abs() < 4 * se) and torch.all((t.mean(0) - 1).abs() < 4 * se)
    assert torch.all((x.std(0) - 1).abs() < 0.03)
    assert torch.equal(build_data(cfg.data, cfg.model).train["x"], data.train["x"])  # seeded by split_seed
    other = build_data(config("data.split_seed=100").data, cfg.model).train["x"]
    assert not torch.equal(other, data.train["x"])
    # at β = 0 every example is at distance ‖xᵢ‖_A (its tail adds nothing), and the score is F(0) − min F
    model = build_model(cfg.model, data)
    scores = data.score(model, "cpu", 0, None)
    a = diagonal("const", 50)
    # (the score reads the float64 draw; the columns hold it in float32, as the model trains on it)
    assert scores["excess_empirical_loss"] == pytest.approx(objective(torch.zeros(50), x, a, 0.0)
                                                            - minimum(x, a, 0.0)[1], rel=1e-8)
    assert scores["excess_empirical_loss"] > 0 and scores["excess_population_loss"] > 0


@pytest.mark.long
def test_a_dp_sgd_sweep_over_dimensions_is_drawn_as_the_papers_figure(cli, tmp_path):
    r = cli("train", "-m", "model=median", "data=median", "method=dp-sgd", "privacy=eps2", "privacy.delta=1e-6",
            "data.A=const,linear", "data.dimension=10,100", "train.seed=0,1", "data.n_train=2000", "data.n_test=2000",
            "train.steps=20", "train.batch_size=200", "train.lr=0.5", "logging.progress=false",
            "logging.memory_steps=0", "hydra.sweep.dir=sweep")
    assert r.returncode == 0, r.stderr
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "sweep").glob("*/summary.json")]
    assert len(summaries) == 8 and all(s["status"] == "ok" and s["epsilon_spent"] <= 2.0 for s in summaries)
    for s in summaries:  # both excess losses, lower is better: the best is the least seen
        assert set(s["metrics"]) == {"excess_empirical_loss", "excess_population_loss"}
        assert s["metric_final"] == s["metrics"]["excess_empirical_loss"] >= 0
        assert s["metric_best"] <= s["metric_final"]
    r = cli("report", "sweep")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "sweep" / "report" / "excess_loss_vs_dimension.png").stat().st_size > 0
    assert "losses as they are" in r.stdout
