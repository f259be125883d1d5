"""dpmem spectrum against closed forms and independent oracles: planted spectra, random-matrix theory for the
noise, a planted power law, per-sample gradients from a micro-batch loop, SGD parameter deltas for the recorded
clipped gradients, dense SVD for orthogonal iteration; subspace re-training against the unprojected method."""

import json
import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from dpmem.cli import main
from dpmem.composition import CONF_DIR, compose_points
from dpmem.config import ConfigError
from dpmem.engine.trainer import Run
from dpmem.methods.subspace import data_identity, privacy_of, save_subspace
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.spectrum import run_spectrum
from dpmem.spectrum.layer import measure, settings
from dpmem.spectrum.linalg import orthogonal_iteration, power_law_slope, residual_norms, top_singular_values
from helpers import seeded

# a ViT small enough for a full p × p basis (digits are 8×8: four 4×4 patches)
TINY = ["model.arch.hidden_size=8", "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2",
        "model.arch.intermediate_size=16", "model.arch.patch_size=4"]


def config(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=["logging.progress=false", "logging.memory_steps=0", "train.device=cpu",
                                            "train.batch_size=32", *overrides])


def make_run(cfg, path) -> Run:
    path.mkdir(parents=True, exist_ok=True)
    return Run(cfg, path)


def planted(m: int, n: int, values: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """U diag(values) Vᵀ with random orthonormal U (m × k), V (n × k); returns the matrix and V."""
    g = torch.Generator().manual_seed(seed)
    k = len(values)
    u = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64)).Q
    return u @ torch.diag(values.to(torch.float64)) @ v.T, v


def test_top_singular_values_recover_a_planted_spectrum():
    values = torch.tensor([5.0, 3.0, 1.0, 0.5, 0.1])
    matrix, _ = planted(40, 30, values)
    assert torch.allclose(top_singular_values(matrix.float(), 5), values.double(), rtol=1e-5)
    assert len(top_singular_values(matrix, 64)) == 30  # at most min(m, n)


def test_orthogonal_iteration_on_chunks_recovers_a_planted_spectrum_and_its_directions():
    values = 10.0 * 0.7 ** torch.arange(12.0)  # a clear gap between consecutive values
    h, v_true = planted(60, 300, values, seed=1)
    chunks = list(h.float().split(7))  # streamed in uneven chunks, as the recorder writes them

    found, basis = orthogonal_iteration(lambda: iter(chunks), 300, 5, iterations=60,
                                        generator=torch.Generator().manual_seed(0))
    assert torch.allclose(found, values[:5].double(), rtol=1e-4)
    overlap = (basis.T @ v_true[:, :5]).abs()  # the same directions up to sign
    assert torch.allclose(overlap, torch.eye(5, dtype=torch.float64), atol=1e-3)
    assert torch.allclose(basis.T @ basis, torch.eye(5, dtype=torch.float64), atol=1e-10)
    # G_k against the dense projection onto the true top-k directions
    g = residual_norms(lambda: iter(chunks), basis, [0, 1, 3, 5])
    for k in (0, 1, 3, 5):
        vk = v_true[:, :k]
        exact = (h - h @ vk @ vk.T).norm(dim=1).max()
        assert g[k] == pytest.approx(float(exact), rel=1e-3)


def test_more_components_than_gradients_give_zeros_and_a_full_orthonormal_basis():
    h, _ = planted(4, 9, torch.tensor([3.0, 2.0, 1.0, 0.5]))
    values, basis = orthogonal_iteration(lambda: iter([h]), 9, 9, iterations=5)
    assert torch.allclose(values[:4], torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64), rtol=1e-6)
    assert torch.allclose(values[4:], torch.zeros(5, dtype=torch.float64), atol=1e-8)
    assert torch.allclose(basis @ basis.T, torch.eye(9, dtype=torch.float64), atol=1e-8)


def test_noise_of_known_sigma_raises_the_tail_as_random_matrix_theory_says():
    """S = Σ clip(gᵢ) of rank 3, privatised by the methods' own mechanism: (S + σC·Z)/B. The singular values
    beyond rank 3 are those of Gaussian noise of std τ = σC/B, inside τ(√n ± √m) (Marchenko–Pastur edges); the
    top three stay near the planted ones when they dominate the noise."""
    m, n, B, C, sigma = 60, 600, 50.0, 1.0, 2.0
    signal = torch.tensor([4000.0, 3000.0, 2000.0])
    s, _ = planted(m, n, signal)
    clean = top_singular_values(s / B, m)
    assert float(clean[3]) < 1e-10  # no tail without noise
    p = torch.nn.Parameter(torch.zeros(m, n))
    noise = GaussianMechanism(sigma, C, B, seeded(0))
    noisy = noise.release({p: s.float().clone()})[p]
    values = top_singular_values(noisy, m)
    tau = sigma * C / B
    tail = values[3:]
    assert float(tail.max()) < 1.05 * tau * (math.sqrt(n) + math.sqrt(m))
    assert float(tail.min()) > 0.95 * tau * (math.sqrt(n) - math.sqrt(m))
    assert torch.allclose(values[:3], signal.double() / B, rtol=0.02)


def test_slope_fit_returns_a_planted_power_law():
    i = torch.arange(1, 1001, dtype=torch.float64)
    slope, intercept = power_law_slope(3.0 * i ** -0.6)
    assert slope == pytest.approx(-0.6, abs=1e-9) and math.exp(intercept) == pytest.approx(3.0, rel=1e-9)
    assert power_law_slope(torch.cat([2.0 * i[:50] ** -1.5, torch.zeros(5, dtype=torch.float64)]))[0] == \
        pytest.approx(-1.5, abs=1e-9)  # zeros (rank beyond the data) are left out


class TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 5), torch.nn.Linear(5, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def test_layer_measure_matches_a_micro_batch_loop():
    """The clipped (flat, over all parameters) batch gradient of each layer, from per-sample gradients of one
    example at a time: its singular values are what measure reports, for C = ∞ and C = 0.5."""
    model = TwoLayer()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 6, generator=g), torch.randint(0, 4, (10,), generator=g)
    layers = {"a.weight": model.a.weight, "b.weight": model.b.weight}
    results = measure(model, [{"x": x[:6], "y": y[:6]}, {"x": x[6:], "y": y[6:]}], _loss, layers,
                      [(None, 0.0), (0.5, 0.0)], expected_batch_size=10.0, top=4, seed=0)
    per_sample = []
    for i in range(10):
        model.zero_grad()
        _loss(model, {"x": x[i:i + 1], "y": y[i:i + 1]}).sum().backward()
        per_sample.append({n: p.grad.clone() for n, p in model.named_parameters()})
    norms = torch.stack([torch.sqrt(sum((t ** 2).sum() for t in gs.values())) for gs in per_sample])
    for result, c in zip(results, (None, 0.5)):
        factors = torch.ones(10) if c is None else (c / (norms + 1e-6)).clamp(max=1.0)
        for name in layers:
            want = sum(f * gs[name] for f, gs in zip(factors, per_sample)) / 10.0
            got = torch.tensor(result["per_layer"][name], dtype=torch.float64)
            assert torch.allclose(got, torch.linalg.svdvals(want.double())[:4], rtol=1e-4, atol=1e-8)


def test_settings_default_to_no_clipping_and_the_privacy_configs_sigma():
    sp = config().spectrum
    assert settings(sp, 1.0, 0.8) == [(None, 0.0), (1.0, 0.0), (1.0, 0.8)]
    sp.clip, sp.sigma = [None, 1.0, 0.1], [0.0, 2.0]
    assert settings(sp, 1.0, 0.8) == [(None, 0.0), (1.0, 0.0), (1.0, 2.0), (0.1, 0.0), (0.1, 2.0)]
    sp.clip = [0.0]
    with pytest.raises(ConfigError, match="spectrum.clip"):
        settings(sp, 1.0, 0.8)


def test_layer_mode_on_digits_clipping_and_noise_flatten_the_spectrum(tmp_path):
    """The CPU twin of DP-GRAPE Fig. 1: the same batch's spectra, no clipping vs C = 1 with σ = 0.5 and 2."""
    cfg = config("spectrum.clip=[null,1.0]", "spectrum.sigma=[0.5,2.0]", "spectrum.steps=[1,3]",
                 "train.batch_size=128", "spectrum.top=16", "train.epochs=1", "method=dp-adam")
    result, text = run_spectrum(cfg, tmp_path)
    assert [s["step"] for s in result["steps"]] == [1, 3]
    for st in result["steps"]:
        by = {(s["clip"], s["sigma"]): s for s in st["settings"]}
        assert list(by) == [(None, 0.0), (1.0, 0.5), (1.0, 2.0)]
        tail = {key: s["mean_normalized"][9] for key, s in by.items()}  # σ₁₀/σ₁, averaged over layers
        # noise of either size dominates the clipped signal here: both near the flat shape of a noise matrix
        assert 2 * tail[(None, 0.0)] < min(tail[(1.0, 0.5)], tail[(1.0, 2.0)])
        assert by[(None, 0.0)]["slope"] < min(by[(1.0, 0.5)]["slope"], by[(1.0, 2.0)]["slope"]) < 0
        assert len(by[(None, 0.0)]["per_layer"]) == len(result["layers"]) == 12
    for f in ("spectrum.json", "spectrum.csv", "spectrum.md", "spectrum_step1.png", "spectrum_step3.pdf"):
        assert (tmp_path / f).is_file()
    assert "C = 1, sigma = 2" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_done"] == 2  # trained between steps
    # spectra of gradients outside the run's noise: the folder is an analysis, not private, whatever σ trained it
    assert summary["analysis"] == "spectrum" and summary["private"] is False and summary["epsilon_spent"] == "inf"
    assert "unclipped" in summary["not_private_because"] and text.startswith("Not private: spectrum.json holds")
    assert json.loads((tmp_path / "spectrum.json").read_text())["private"] is False


def test_recorded_gradient_is_the_clipped_mean_that_sgd_steps_on(tmp_path):
    """dp-sgd without noise (privacy=none) steps θ ← θ − lr·ḡ: the recorded row is −Δθ/lr."""
    cfg = config("method=dp-sgd", "privacy=none", "train.steps=1", "train.lr=0.5", "spectrum.chunk=4",
                 "spectrum.k=3", *TINY)
    from dpmem.spectrum.trajectory import GradientRecorder
    recorder = GradientRecorder(tmp_path / "gradients", None, chunk=4, source={})
    run = Run(cfg, tmp_path, observers=(recorder,))
    model = run.prepare().model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    named = list(model.named_parameters())
    assert [n for n, _ in recorder.named] == [n for n, _ in named]
    run.execute()
    recorder.flush()
    row = torch.load(tmp_path / "gradients" / "chunk_00000.pt")[0]
    step = torch.cat([(before[n] - p.detach()).reshape(-1) / 0.5 for n, p in named])
    assert torch.allclose(row, step, atol=1e-6)


def test_trajectory_mode_records_in_chunks_and_its_pca_matches_a_dense_svd(tmp_path):
    cfg = config("method=dp-adam", "train.steps=11", "spectrum.mode=trajectory", "spectrum.chunk=4",
                 "spectrum.k=4", "spectrum.iterations=200", "spectrum.ks=[1,2]",
                 "spectrum.params=[vit.layers.*]", *TINY)
    result, text = run_spectrum(cfg, tmp_path)
    index = json.loads((tmp_path / "gradients" / "index.json").read_text())
    assert index["rows"] == 11 and len(index["files"]) == 3  # 4 + 4 + 3
    assert all(n.startswith("vit.layers.") for n in index["names"])
    h = torch.cat([torch.load(tmp_path / "gradients" / f) for f in index["files"]])
    assert h.shape == (11, index["p"])
    assert torch.allclose(torch.tensor(result["singular_values"], dtype=torch.float64), torch.linalg.svdvals(h.double())[:4], rtol=1e-4)
    assert set(result["G_k"]) == {"0", "1", "2"} and result["G_k"]["0"] == pytest.approx(float(h.norm(dim=1).max()))
    stored = torch.load(tmp_path / "subspace.pt")
    assert stored["basis"].shape == (index["p"], 4) and stored["source"]["noised"] is False
    assert "slope" in text and (tmp_path / "spectrum_trajectory.png").is_file()
    # analysed again from the folder, with fewer components, without training
    again = config("spectrum.mode=trajectory", f"spectrum.gradients={tmp_path}", "spectrum.k=2", *TINY)
    result2, _ = run_spectrum(again, tmp_path / "again")
    assert result2["k"] == 2 and result2["rows"] == 11
    assert result2["private"] is False and "subspace.pt" in result2["not_private_because"]
    # un-noised gradients on disk: not private from the ledger's first line, and no result of dpmem report's
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["analysis"] == "spectrum" and summary["private"] is False
    assert "un-noised" in summary["not_private_because"]
    ledger = [json.loads(x) for x in (tmp_path / "privacy.jsonl").read_text().splitlines()]
    assert len(ledger) > 2 and {x["epsilon"] for x in ledger} == {"inf"}
    main(["report", str(tmp_path)])
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| dp-adam |" not in report
    assert f"- {tmp_path}: dpmem spectrum (dp-adam on digits), not private: gradients/ holds" in report


def _basis_file(path, model, k, source, seed=0):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    p = sum(t.numel() for _, t in named)
    basis = torch.linalg.qr(torch.randn(p, p, generator=torch.Generator().manual_seed(seed),
                                        dtype=torch.float64)).Q[:, :k]
    save_subspace(path, [n for n, _ in named], [tuple(t.shape) for _, t in named], basis, torch.ones(k), source)
    return basis, named


def _final_params(cfg, run_dir):
    run = make_run(cfg, run_dir)
    run.prepare()
    run.execute()
    assert run.summary["status"] == "ok", run.summary["error"]
    return run, torch.cat([p.detach().reshape(-1) for _, p in run.model.named_parameters()])


@pytest.mark.parametrize("where", ["clipped", "privatised"])
def test_subspace_of_full_dimension_equals_the_unprojected_method(tmp_path, where):
    base = ["method=dp-adam", "train.steps=3", "privacy.noise_seed=5", "privacy.sampler_seed=5", *TINY]
    probe = make_run(config(*base), tmp_path / "probe")
    probe.prepare()
    p = sum(t.numel() for t in probe.model.parameters())
    public = {"data": {"name": "some-public-set", "path": None}, "noised": False}
    _basis_file(tmp_path / "full.pt", probe.model, p, public)
    _, plain = _final_params(config(*base), tmp_path / "plain")
    run, projected = _final_params(config(*base, f"method.subspace.path={tmp_path / 'full.pt'}",
                                          f"method.subspace.where={where}"), tmp_path / "projected")
    assert torch.allclose(plain, projected, atol=1e-5)
    assert run.summary["private"] and run.summary["subspace"]["private"] and run.summary["epsilon_spent"] > 0


def test_privatised_projection_keeps_every_update_in_the_subspace_and_a_leak_is_recorded(tmp_path):
    base = ["method=dp-sgd", "train.steps=2", "train.lr=1.0", *TINY]
    probe = make_run(config(*base), tmp_path / "probe")
    probe.prepare()
    start = torch.cat([p.detach().reshape(-1) for p in probe.model.parameters()])
    # computed from this training set's clipped gradients: not private
    leak = {"data": data_identity(probe.cfg.data), "noised": False}
    basis, _ = _basis_file(tmp_path / "leak.pt", probe.model, 3, leak)
    run, end = _final_params(config(*base, f"method.subspace.path={tmp_path / 'leak.pt'}",
                                    "method.subspace.where=privatised"), tmp_path / "run")
    delta = (end - start).double()  # same init (train.seed)
    assert float(delta.norm()) > 0
    # float32 parameters: rounding only (an unprojected update would leave about all of its norm)
    assert float((delta - basis @ (basis.T @ delta)).norm()) < 1e-3 * float(delta.norm())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["private"] is False and summary["epsilon_spent"] == "inf"
    assert "not private" in summary["subspace"]["why"]


def test_subspace_privacy_rule():
    data = config().data
    assert privacy_of(None, data)[0] is False  # no provenance: assume the worst
    assert privacy_of({"data": data_identity(data), "noised": False}, data)[0] is False
    assert privacy_of({"data": data_identity(data), "noised": True}, data)[0] is True
    assert privacy_of({"data": {"name": "other", "path": None}, "noised": False}, data)[0] is True


def test_subspace_configuration_errors(tmp_path):
    probe = make_run(config("method=dp-adam", *TINY), tmp_path / "probe")
    probe.prepare()
    _basis_file(tmp_path / "s.pt", probe.model, 4, {})
    with pytest.raises(ConfigError, match="grape has no option 'subspace'"):  # its sums are projected already
        compose_points([["method=grape", f"method.subspace.path={tmp_path / 's.pt'}"]])
    with pytest.raises(ConfigError, match="other parameters"):  # the basis is for another model
        make_run(config("method=dp-adam", f"method.subspace.path={tmp_path / 's.pt'}"), tmp_path / "b").prepare()
    with pytest.raises(ConfigError, match="method.subspace.k"):
        make_run(config("method=dp-adam", f"method.subspace.path={tmp_path / 's.pt'}", "method.subspace.k=5", *TINY),
            tmp_path / "c").prepare()
    with pytest.raises(ConfigError, match="not a file"):
        make_run(config("method=dp-adam", f"method.subspace.path={tmp_path / 'none.pt'}"), tmp_path / "d").prepare()


def test_cli_spectrum_takes_one_configuration(capsys):
    with pytest.raises(SystemExit) as e:
        main(["spectrum", "mode=layer", "method=dp-adam,grape"])
    assert e.value.code == 2 and "one configuration" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["spectrum", "mode=sideways"])
    assert "spectrum.mode" in capsys.readouterr().err


def test_every_spectrum_experiment_composes_and_names_its_mode():
    from pathlib import Path

    from dpmem.composition import compose_point, sweep_points
    files = sorted((Path(CONF_DIR) / "experiment" / "spectrum").glob("*.yaml"))
    assert len(files) == 9
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for f in files:
            (point,) = sweep_points([f"experiment=spectrum/{f.stem}"])  # a nested option is a known option
            cfg = compose_point(point)
            want = "trajectory" if f.stem.startswith("trajectory") else "layer"
            assert cfg.spectrum.mode.value == want or f.stem.startswith("retrain"), f.stem
            if f.stem.startswith("retrain"):
                assert cfg.method.subspace.path == "SET-ME" and cfg.method.name == "dp-adam"


@pytest.mark.parametrize("key", ["params", "gradients"])
def test_a_trajectory_setting_in_layer_mode_is_refused_not_ignored(tmp_path, key):
    """spectrum.params=['*.query.*'] in mode=layer measured every default layer, without a word."""
    value = "['*.query.*']" if key == "params" else str(tmp_path)
    with pytest.raises(ConfigError, match=rf"spectrum\.{key}: is mode=trajectory's .* spectrum\.layers names"):
        run_spectrum(config(f"spectrum.{key}={value}", *TINY), tmp_path / "out")
    assert not (tmp_path / "out").exists()
