"""Correlated noise (privacy.noise=bandmf|bisr, train.sampling=cyclic): each release's noise is the matrix
mechanism's C⁻¹z (checked against C built densely here, and z drawn again from its key), the compiled step's flat
release equals the eager one, cyclic sampling keeps a record in its group's steps, and ε is dp-accounting's event
built here from the summary (and jax-privacy's, where it is installed)."""

import json
import math
import re
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch

from dpmem.config import ConfigError
from dpmem.engine.trainer import Run, run_length, run_training
from dpmem.methods import METHODS, validate
from dpmem.privacy.accounting import calibrate_sigma
from dpmem.privacy.calibrate import calibrate
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, derive, seed_key
from dpmem.privacy.sampling import cyclic_batches
from dpmem.privacy.strategies import make_strategy
from dpmem.report.pages import Page
from helpers import config, dies_at, kept_runs

# random 8×8 images (160 records: a few groups of a batch of 32) and a one-block ViT: seconds a run
SMALL = ["model=vit-tiny", "data=synthetic", "data.n_train=160", "data.image_size=8", "data.channels=1",
         "model.arch.hidden_size=16", "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2",
         "model.arch.intermediate_size=32", "model.arch.patch_size=4", "train.device=cpu"]
SEEDS = ["privacy.noise_seed=3", "privacy.sampler_seed=3"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def kept(monkeypatch):
    """Each run's trained weights, flat, by its folder's name."""
    weights = {}
    real_execute = Run.execute

    def keep(self):
        out = real_execute(self)
        weights[self.run_dir.name] = torch.cat([p.detach().flatten() for p in self.model.parameters()])
        return out
    monkeypatch.setattr("dpmem.engine.trainer.Run.execute", keep)
    return weights


def dense_c(strategy, steps, restart=None):
    """C over `steps` releases, built densely: the strategy's Toeplitz matrix, block-diagonal where a projected
    method's window restarts it (1-based steps t ≡ 0 mod F begin a block)."""
    starts = [0] + ([t - 1 for t in range(restart, steps + 1, restart) if t > 1] if restart else [])
    c = np.zeros((steps, steps))
    for begin, end in zip(starts, starts[1:] + [steps]):
        coefs = strategy.strategy_coefs(end - begin)
        for i in range(begin, end):
            c[i, begin:i + 1] = coefs[:i + 1 - begin][::-1]
    return c


def noises(mechanism, steps, shapes, flat=False):
    """The noise of `steps` releases of zero sums (of `shapes`), one row per release, times q·n / σC."""
    rows = []
    for _ in range(steps):
        if flat:  # the compiled step's: views of one flat sum
            whole = torch.zeros(sum(math.prod(s) for s in shapes), dtype=torch.float64)
            views = dict(enumerate(v.view(s) for v, s in zip(whole.split([math.prod(s) for s in shapes]), shapes)))
            mechanism.release(views, flat=whole)
            out = whole
        else:
            summed = {i: torch.zeros(s, dtype=torch.float64) for i, s in enumerate(shapes)}
            out = torch.cat([t.flatten() for t in mechanism.release(summed).values()])
        rows.append(out.numpy() * mechanism.expected_batch_size / mechanism.noise_std(None))
    return np.stack(rows)


@pytest.mark.parametrize("name,bands,restart", [("bandmf", 3, None), ("bisr", 3, None), ("bandmf", 3, 4),
                                                ("bisr", 4, 3)])
def test_each_release_is_the_matrix_mechanisms_and_c_times_the_noise_is_white(name, bands, restart):
    steps, shapes = 9, [(40, 50), (1000,)]
    strategy = make_strategy(name, bands, min(steps, restart or steps))
    mechanism = GaussianMechanism(2.0, 0.5, 8.0, Draws(seed_key(5), "noise"), strategy=strategy, restart=restart)
    w = noises(mechanism, steps, shapes)
    z = dense_c(strategy, steps, restart) @ w  # z = C w: the fresh draws, if w = C⁻¹ z
    drawn = np.stack([Draws(derive(seed_key(5), "correlated/0", i), "noise").randn(3000, dtype=torch.float64).numpy()
                      for i in range(steps)])
    np.testing.assert_allclose(z, drawn, atol=1e-9)
    # and without the keys: z's rows are uncorrelated standard normals (C w white), w's are not
    corr = np.corrcoef(z)
    assert np.abs(corr - np.eye(steps)).max() < 0.08 and np.abs(z.std(1) - 1).max() < 0.05
    assert np.abs(np.corrcoef(w) - np.eye(steps)).max() > 0.2


def test_the_compiled_steps_flat_release_draws_the_eager_ones_noise():
    for name in ("bandmf", "bisr"):
        strategy = make_strategy(name, 3, 6)
        eager = GaussianMechanism(1.0, 1.0, 4.0, Draws(seed_key(2), "noise"), strategy=strategy)
        flat = GaussianMechanism(1.0, 1.0, 4.0, Draws(seed_key(2), "noise"), strategy=strategy)
        np.testing.assert_array_equal(noises(eager, 6, [(500,)]), noises(flat, 6, [(500,)], flat=True))


def test_cyclic_sampling_keeps_each_record_in_its_groups_steps_at_the_groups_rate():
    n, batch, groups, steps = 1000, 50, 4, 400
    seen = {}
    sizes = []
    for t, index in enumerate(cyclic_batches(n, batch, groups, steps, Draws(seed_key(1), "batches"))):
        sizes.append(len(index))
        for i in index.tolist():
            seen.setdefault(i, set()).add(t % groups)
    assert all(len(g) == 1 for g in seen.values())  # a record joins only its own group's steps
    assert sorted(len([i for i, g in seen.items() if g == {k}]) for k in range(groups)) == [250] * 4
    assert abs(np.mean(sizes) - batch) < 1.5  # rate B / floor(n/G) in a group of n/G: B a step on average
    again = list(cyclic_batches(n, batch, groups, 3, Draws(seed_key(1), "batches")))
    assert all(torch.equal(a, b) for a, b in zip(again, list(cyclic_batches(n, batch, groups, steps,
                                                                             Draws(seed_key(1), "batches")))))


def amplified(sigma, q_group, steps, groups, delta):
    """dp-accounting's ε of ceil(T/G) Poisson-subsampled Gaussians at the group's rate (Choquette-Choo et al. 2023)."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q_group, dp_accounting.GaussianDpEvent(sigma)), math.ceil(steps / groups))
    return dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3).compose(event).get_epsilon(delta)


@pytest.mark.parametrize("method", ["dp-adam", "grape"])
def test_a_bandmf_run_spends_the_amplified_event_of_its_summary(tmp_path, method):
    own = ["method.rank=4"] if method == "grape" else []
    s = run_training(config(f"method={method}", "privacy.noise=bandmf", "privacy.bands=3", "train.sampling=cyclic",
                            "train.steps=7", "privacy.epsilon=4", *SMALL, *SEEDS, *own), tmp_path)
    assert s["status"] == "ok" and s["noise"] == "bandmf" and s["groups"] == 3 and s["bands"] == 3
    n, batch = s["n_train"], 32
    assert s["group_rate"] == batch / (n // 3)
    # the gradient's and the loss's releases as one multiplier (privacy.train_loss=private: c = 10)
    joint = s["sigma"] / math.sqrt(1 + 10 ** -2)
    spent = amplified(joint, batch / (n // 3), 7, 3, s["delta"])
    assert s["epsilon_spent"] == pytest.approx(spent, rel=1e-9) and spent <= 4
    jp = pytest.importorskip("jax_privacy.experimental.accounting")
    event = jp.amplified_bandmf_event(joint, 7, num_bands=3, sampling_prob=batch / (n // 3))
    theirs = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3).compose(event).get_epsilon(s["delta"])
    assert s["epsilon_spent"] == pytest.approx(theirs, rel=1e-9)


def test_adam_under_correlated_noise_is_told_the_step_noise_matched_rate_and_keeps_its_own(tmp_path, capsys):
    """Issue 73: correlated noise at independent noise's learning rate trained far worse without a word. The run
    warns with docs/benchmarks/correlated.md's rule, lr × σ ÷ σ_independent × ‖C⁻¹'s last row‖ (C⁻¹ inverted
    densely here; σ_independent calibrated for Poisson sampling at the run's ε, δ, q and steps), names its noise and
    that rate in the closing table, and trains at the lr it was given."""
    s = run_training(config("method=dp-adam", "privacy.noise=bandmf", "privacy.bands=3", "train.sampling=cyclic",
                            "train.steps=7", "privacy.epsilon=4", "train.lr=0.01", *SMALL, *SEEDS), tmp_path)
    out = capsys.readouterr()
    c = np.array(make_strategy("bandmf", 3, 7).coefs)
    row = np.linalg.norm(np.linalg.inv(sum(np.diag(np.full(7 - j, c[j]), -j) for j in range(3)))[-1])
    independent = calibrate_sigma(4, s["delta"], s["sample_rate"], 7, sampling="poisson",
                                  dataset_size=s["n_train"], loss_noise=10)
    want = 0.01 * s["sigma"] / independent * row
    assert s["status"] == "ok" and s["lr"] == 0.01
    assert s["lr_step_noise_matched"] == pytest.approx(want, rel=1e-9) and want > 0.015
    assert out.err.count("dpmem: warning: train.lr=0.01 with privacy.noise=bandmf") == 1
    assert f"train.lr={want:.3g} (docs/benchmarks/correlated.md)" in out.err
    assert f"bandmf, 3 bands over 7 steps (lr 0.01; step-noise-matched lr {want:.4g})" in out.out


def test_the_warned_rate_is_the_benchmarks_factor_on_its_task():
    """The rule the warning computes, on the benchmark's vit-digits task (dp-adam, ε 8, bands 8, 337 steps), is the
    factor docs/benchmarks/correlated.md's lr-matched column ran at (written by scripts/bench_correlated.py)."""
    cell = Page(ROOT / "docs/benchmarks/correlated.md").cell("bandmf, lr matched", task="vit-digits",
                                                               method="dp-adam", ε="8")
    bands, factor = re.search(r"b = (\d+), lr × ([\d.]+)", cell).groups()
    cfg = config("method=dp-adam", "data=digits", "train.steps=null", "train.batch_size=64", "train.epochs=15",
                 "privacy.epsilon=8", "privacy.noise=bandmf", f"privacy.bands={bands}", "train.sampling=cyclic",
                 "train.lr=1")
    steps, sampling = run_length(cfg, 1437)
    mechanism = calibrate(cfg, METHODS["dp-adam"].spec, 1437, steps, sampling, torch.device("meta"))
    assert steps == 337 and f"{mechanism.summary['lr_step_noise_matched']:.2f}" == factor


def test_a_bisr_run_spends_one_gaussian_of_its_min_separation_sensitivity(tmp_path):
    s = run_training(config("method=dp-adam", "privacy.noise=bisr", "privacy.bands=3", "train.sampling=cyclic",
                            "train.steps=30", "train.batch_size=16", "privacy.epsilon=4", *SMALL, *SEEDS), tmp_path)
    n = s["n_train"]
    groups = n // 16
    assert s["status"] == "ok" and s["groups"] == groups and s["noise_horizon"] == 30
    k = math.ceil(30 / groups)
    # C densely: the inverse of bisr's banded C⁻¹ over the 30 steps; its worst participation pattern by brute force
    # over the offsets (k participations `groups` apart: C's coefficients are positive and decreasing)
    d = np.array(make_strategy("bisr", 3, 30).coefs)
    cinv = sum(np.diag(np.full(30 - j, d[j]), -j) for j in range(3))
    c = np.linalg.inv(cinv)
    assert np.abs(np.linalg.norm(c, axis=0).max() - 1) < 1e-9
    sens = max(np.linalg.norm(c @ np.isin(np.arange(30), np.arange(o, 30, groups)).astype(float))
               for o in range(groups))
    joint = s["sigma"] / math.sqrt(1 + 10 ** -2)
    event = dp_accounting.GaussianDpEvent(joint / max(sens, math.sqrt(k)))
    spent = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3).compose(event).get_epsilon(s["delta"])
    assert s["epsilon_spent"] == pytest.approx(spent, rel=1e-6) and spent <= 4


@pytest.mark.parametrize("overrides,key", [
    (["privacy.noise=bandmf", "privacy.bands=4", "train.sampling=poisson"], "train.sampling"),
    (["train.sampling=cyclic"], "train.sampling"),
    (["privacy.noise=bandmf"], "privacy.bands"),
    (["privacy.bands=3"], "privacy.bands"),
    (["method=dp-sgd-rc", "privacy.noise=bisr", "privacy.bands=2", "train.sampling=cyclic"], "privacy.noise"),
    (["method=adam", "privacy=none", "privacy.noise=bisr", "privacy.bands=2", "train.sampling=cyclic"],
     "privacy.noise"),
])
def test_correlated_noise_without_what_it_is_accounted_with_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        validate(config(*overrides))
    assert e.value.key == key


def test_auto_sampling_is_cyclic_for_correlated_noise_and_poisson_for_independent():
    from dpmem.engine.trainer import run_length
    assert run_length(config("privacy.noise=bisr", "privacy.bands=2"), 1000)[1] == "cyclic"
    assert run_length(config("method=dp-adam"), 1000)[1] == "poisson"


def test_more_bands_than_groups_of_a_batch_is_refused_naming_the_bands(tmp_path):
    with pytest.raises(ConfigError, match="privacy.bands: 50 groups"):
        run_training(config("method=dp-adam", "privacy.noise=bandmf", "privacy.bands=50", "train.sampling=cyclic",
                            *SMALL), tmp_path)


@pytest.mark.parametrize("method,noise", [("dp-adam", "bandmf"), ("grape", "bandmf"), ("dp-adam", "bisr")])
def test_a_run_killed_mid_band_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, method, noise):
    captured = kept_runs(monkeypatch)
    own = ["method.refresh=3", "method.rank=4"] if method == "grape" else []
    cfg = lambda *more: config(f"method={method}", f"privacy.noise={noise}", "privacy.bands=3",  # noqa: E731
                               "train.sampling=cyclic", "train.steps=7", "privacy.epsilon=1", *SMALL, *SEEDS, *own,
                               *more)
    oracle = run_training(cfg(), tmp_path / "oracle")
    real_step = dies_at(monkeypatch, METHODS[method], 6)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(cfg("train.checkpoint_every=2"), tmp_path / "resumed")
    monkeypatch.setattr(METHODS[method], "step", real_step)
    resumed = run_training(cfg("train.checkpoint_every=2"), tmp_path / "resumed")  # from step 4: buffers of 2 and 3
    assert resumed["resumed_from_step"] == 4 and resumed["epsilon_spent"] == oracle["epsilon_spent"]
    for (name, a), b in zip(captured["oracle"].model.named_parameters(), captured["resumed"].model.parameters()):
        assert torch.equal(a, b), name


def test_grapes_buffers_are_projected_and_bisr_keeps_none(tmp_path, monkeypatch):
    """bandmf keeps b − 1 vectors of each release's size: r × n per projected matrix under grape (the rest full),
    every parameter's size under dp-adam; bisr none."""
    kept = {}
    real_execute = Run.execute

    def keep(self):
        out = real_execute(self)
        kept[self.run_dir.name] = (self.method, self.method.mechanism.correlated.tensors())
        return out
    monkeypatch.setattr("dpmem.engine.trainer.Run.execute", keep)
    for method, noise in (("dp-adam", "bandmf"), ("grape", "bandmf"), ("dp-adam", "bisr")):
        run_training(config(f"method={method}", f"privacy.noise={noise}", "privacy.bands=4", "train.sampling=cyclic",
                            "train.steps=5", "method.rank=2" if method == "grape" else "train.seed=0", *SMALL, *SEEDS),
                     tmp_path / f"{method}-{noise}")
    size = lambda name: sum(t.numel() for t in kept[name][1])  # noqa: E731
    adam = kept["dp-adam-bandmf"][0]
    full = sum(p.numel() for p in adam.model.parameters() if p.requires_grad)
    assert size("dp-adam-bandmf") == 3 * full  # b − 1 = 3 buffers of every trainable parameter
    grape = kept["grape-bandmf"][0]
    projected = sum(grape.shapes[p].numel() for p in grape.privatizer.params)
    assert size("grape-bandmf") == 3 * projected < 3 * full
    assert size("dp-adam-bisr") == 0


def test_the_report_keeps_each_strategy_a_row_and_composes_their_events(tmp_path, capsys):
    from dpmem.report.runs import collect, write
    runs = {}
    for noise in ("independent", "bandmf"):
        more = ["privacy.noise=bandmf", "privacy.bands=2", "train.sampling=cyclic"] if noise == "bandmf" else []
        runs[noise] = run_training(config("method=dp-adam", "train.steps=4", "privacy.epsilon=2", *SMALL, *more),
                                   tmp_path / noise)
    summaries, missing = collect([tmp_path])
    md = write(tmp_path / "report", summaries, missing)
    assert "dp-adam (bands=2, noise=bandmf, sampling=cyclic)" in md and "dp-adam (bands=None, noise=independent" in md
    assert f"{tmp_path / 'bandmf'}: bandmf (2 bands, 2 cyclic groups): amplified bandmf" in md
    # the two releases composed: the Poisson run's 4 steps and the bandmf run's ceil(4/2) group steps, built here
    ind, band = runs["independent"], runs["bandmf"]
    c = 1 / math.sqrt(1 + 10 ** -2)
    events = [dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
                  32 / ind["n_train"], dp_accounting.GaussianDpEvent(ind["sigma"] * c)), 4),
              dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
                  32 / (band["n_train"] // 2), dp_accounting.GaussianDpEvent(band["sigma"] * c)), 2)]
    both = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3).compose(
        dp_accounting.ComposedDpEvent(events)).get_epsilon(max(ind["delta"], band["delta"]))
    assert f"ε = {both:.4g}" in md


@pytest.mark.parametrize("edit", ["config", "ledger"])
def test_no_edit_of_how_a_run_sampled_or_correlated_its_noise_lowers_the_composed_epsilon(tmp_path, edit):
    from omegaconf import OmegaConf

    from dpmem.report.runs import collect, write
    for noise in ("independent", "bandmf"):
        more = ["privacy.noise=bandmf", "privacy.bands=4", "train.sampling=cyclic"] if noise == "bandmf" else []
        run_training(config("method=dp-adam", "train.steps=8", "privacy.epsilon=2", *SMALL, *more), tmp_path / noise)

    def composed():
        md = write(tmp_path / "report", *collect([tmp_path / "independent", tmp_path / "bandmf"]))
        return float(md.split("releases all: ε = ")[1].split()[0]), md
    before, _ = composed()
    folder = tmp_path / "bandmf"
    if edit == "config":  # claim independent Poisson noise in config.yaml
        cfg = OmegaConf.load(folder / "config.yaml")
        cfg.privacy.noise, cfg.privacy.bands, cfg.train.sampling = "independent", None, "auto"
        OmegaConf.save(cfg, folder / "config.yaml")
    else:  # claim independent Poisson noise in every ledger line and in the summary
        lines = [json.loads(x) for x in (folder / "privacy.jsonl").read_text().splitlines()]
        (folder / "privacy.jsonl").write_text("".join(json.dumps({**line, "sampling": "poisson", "groups": None,
                                                                  "strategy": None}) + "\n" for line in lines))
        summary = json.loads((folder / "summary.json").read_text())
        summary.update(noise="independent", sampling="poisson", groups=None)
        (folder / "summary.json").write_text(json.dumps(summary))
    after, md = composed()
    assert after >= before * (1 - 1e-9), md


@pytest.mark.parametrize("method,noise", [("dp-adam", "bandmf"), ("grape", "bisr")])
def test_a_compiled_correlated_run_is_one_graph_and_trains_to_the_eager_weights(tmp_path, kept, method, noise):
    """The compiled micro-batch is one graph; its flat sum is released by the same mechanism, eagerly (the
    correlated draws are made there, on the host's key, as the eager step makes them): the weights agree."""
    own = ["method.rank=4", "method.refresh=3"] if method == "grape" else []
    overrides = [f"method={method}", f"privacy.noise={noise}", "privacy.bands=3", "train.sampling=cyclic",
                 "train.steps=6", "train.physical_batch_size=16", "train.static_shapes=true", *SMALL, *SEEDS, *own]
    eager = run_training(config(*overrides), tmp_path / "eager")
    compiled = run_training(config(*overrides, "train.compile=true", "train.compile_backend=eager"),
                            tmp_path / "compiled")
    assert compiled["epsilon_spent"] == eager["epsilon_spent"]
    assert compiled["compiled"]["graphs_per_function"] == {"microbatch": 1}, compiled["compiled"]
    assert compiled["compiled"]["graph_breaks"] == 0 and compiled["compiled"]["recompiles"] == 0
    torch.testing.assert_close(kept["compiled"], kept["eager"], rtol=1e-5, atol=1e-6)


def test_a_correlated_run_checkpointed_on_another_kind_of_device_is_refused_in_one_line(tmp_path, monkeypatch):
    """Independent noise is keyed afresh there (docs/sharp-edges.md); correlated noise would continue draws that
    device cannot make again. The checkpoint is marked as a CUDA one here (a CPU machine has no other device)."""
    overrides = ["method=dp-adam", "privacy.noise=bandmf", "privacy.bands=2", "train.sampling=cyclic",
                 "train.checkpoint_every=2", "train.steps=4", *SMALL]
    real_step = dies_at(monkeypatch, METHODS["dp-adam"], 3)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config(*overrides), tmp_path)
    monkeypatch.setattr(METHODS["dp-adam"], "step", real_step)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    state["mechanism"]["noise"]["device"] = "cuda"
    torch.save(state, tmp_path / "checkpoint.pt")
    with pytest.raises(ConfigError, match="train.device: the checkpoint's noise was drawn on cuda.*resume it on cuda"):
        run_training(config(*overrides), tmp_path)


def test_every_clipping_mode_and_galore_dp_naive_release_the_same_correlated_noise(tmp_path, kept):
    """The strategy lives in the release, after any clipping mode has formed the clipped sums: with the same
    batches and noise keys, dp-adam's five modes train to materialize's weights (to float32's rounding of the
    clipped sums: a mode's noise gone astray would move them by a step), and galore-dp-naive runs with its buffers
    restarted at each refresh."""
    common = ["privacy.noise=bandmf", "privacy.bands=3", "train.sampling=cyclic", "train.steps=4", *SMALL, *SEEDS]
    for mode in ("materialize", "bk", "fgc", "ghost", "mixed"):
        s = run_training(config("method=dp-adam", f"method.clipping={mode}", *common), tmp_path / mode)
        assert s["status"] == "ok" and s["clipping"] == mode
    for mode in ("bk", "fgc", "ghost", "mixed"):
        torch.testing.assert_close(kept[mode], kept["materialize"], rtol=1e-4, atol=2e-5, msg=mode)
    s = run_training(config("method=galore-dp-naive", "method.rank=4", "method.refresh=2", *common), tmp_path / "g")
    assert s["status"] == "ok" and s["noise"] == "bandmf" and s["noise_horizon"] == 2
