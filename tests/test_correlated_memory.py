"""Correlated noise's memory (issue 65): the meta plan of bandmf and bisr equals the live-tensor counter of a run's
steps on real CPU tensors once bandmf holds all its b − 1 buffers; the breakdown's noise buffers are b − 1 copies of
what the method releases, sized here from the model's parameter shapes (every parameter for dp-adam; r × max(m, n)
per projected matrix and the rest whole for grape; one scalar for dpzero; every parameter for galore-dp-naive, which
projects after the release); and `dpmem plan` gives the most bands that fit a budget, which plans at that many bands
and one more confirm."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from dpmem.composition import CONF_DIR
from dpmem.data import build_data, example_batch
from dpmem.engine.assemble import assemble
from dpmem.engine.chooser import candidate, nothing_fits
from dpmem.engine.planner import plan, reserved_estimate
from dpmem.engine.roofline import device as plan_device
from dpmem.engine.trainer import run_length
from dpmem.metering import LiveTensorCounter, labelled_forward
from dpmem.methods.projected_adam import choose_projected
from dpmem.models import build_model

VIT = ["model=vit-tiny", "memory.target=cpu", "train.batch_size=8", "logging.progress=false"]


def config(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=[*VIT, *overrides])


def noise(name: str, bands: int) -> list[str]:
    return [f"privacy.noise={name}", f"privacy.bands={bands}", "train.sampling=cyclic"]


def measured(cfg, warm: int) -> tuple[int, dict]:
    """The run's own mechanism (calibrated, keyed draws) on real CPU tensors: `warm` steps, then two more, whose
    peak the live-tensor counter gives, beside what the run keeps between steps and its batch. It counts from the
    end of the first step, as the plan does: a tensor a later step makes and keeps (a scalar) is seen too."""
    torch.manual_seed(cfg.train.seed)
    data = build_data(cfg.data, cfg.model)
    steps, sampling = run_length(cfg, data.n_train)
    model = build_model(cfg.model, data, weights=False)
    parts = assemble(cfg, torch.device("cpu"), data, model, steps=steps, sampling=sampling)
    batch = [example_batch(data, cfg.train.batch_size, "cpu")]
    loss_fn = labelled_forward(parts.per_sample_loss)
    parts.method.step(batch, loss_fn)
    counter = LiveTensorCounter().track_state(model, parts.method).track(batch[0].values(), "activations")
    with counter:
        for _ in range(warm - 1):
            parts.method.step(batch, loss_fn)
        counter.peak = counter.current  # the last two steps' peak
        for _ in range(2):
            parts.method.step(batch, loss_fn)
    return counter.peak, counter.peak_breakdown


def released_bytes(cfg) -> int:
    """The bytes of one release, from the parameters' shapes: grape's projected matrices r × max(m, n) (it projects
    the smaller side), every other trainable parameter whole; dpzero one float32 scalar."""
    if cfg.method.name == "dpzero":
        return 4
    model = build_model(cfg.model, build_data(cfg.data, cfg.model), weights=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if cfg.method.name != "grape":
        return 4 * sum(p.numel() for p in trainable)
    m = cfg.method
    projected = choose_projected(model, m.projected, m.rank, m.project_embeddings)
    assert projected and len(projected) < len(trainable)  # grape keeps some parameters' buffers full-size
    return 4 * sum(m.rank * max(p.shape) if p in projected else p.numel() for p in trainable)


CASES = {  # (overrides, bands b or p)
    "dp-adam bandmf": (["method=dp-adam"], "bandmf", 6),
    "grape bandmf": (["method=grape", "method.rank=8"], "bandmf", 6),
    "dp-adam bisr": (["method=dp-adam"], "bisr", 6),
    "dpzero bandmf": (["method=dpzero"], "bandmf", 6),
    "galore-dp-naive bandmf": (["method=galore-dp-naive"], "bandmf", 6),  # releases whole sums, then projects
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_equals_a_real_runs_counted_steps_with_every_noise_buffer(case):
    """A meta plan (3 steps, `dpmem memory`'s) against a run's steps on CPU past its first b, where a run holds all
    b − 1 buffers: the same peak and breakdown; the breakdown's noise buffers are b − 1 releases, in training and in
    evaluation; bisr keeps none."""
    overrides, name, bands = CASES[case]
    cfg = config(*overrides, *noise(name, bands))
    planned = plan(cfg)
    peak, breakdown = measured(cfg, warm=bands + 1)
    kept = (bands - 1) * released_bytes(cfg) if name == "bandmf" else 0
    assert planned["guessed_truth_values"] == 0
    assert planned["training"]["peak_bytes"] == peak and planned["training"]["breakdown"] == breakdown
    assert breakdown["noise_buffers"] == kept
    assert planned["evaluation"]["breakdown"]["noise_buffers"] == kept
    assert planned["noise"]["strategy"] == name and planned["noise"]["buffers"] == (bands - 1 if kept else 0)


@pytest.mark.parametrize("case", ["dp-adam bandmf", "grape bandmf"])
def test_each_band_adds_one_release_to_the_peak(case):
    """peak(b) − peak(b₀) = (b − b₀) × one release, the rule `dpmem plan` extrapolates the bands by; grape's release
    is smaller than dp-adam's (its projected matrices), by the shapes alone."""
    overrides, _, _ = CASES[case]
    three, six = (plan(config(*overrides, *noise("bandmf", b))) for b in (3, 6))
    size = released_bytes(config(*overrides))
    for part in ("training", "evaluation"):
        assert six[part]["peak_bytes"] - three[part]["peak_bytes"] == 3 * size
    assert three["noise"]["band_bytes"] == size
    if case == "grape bandmf":
        assert size < released_bytes(config("method=dp-adam"))


def test_bisr_holds_its_past_draws_only_while_it_redraws_them():
    """bisr keeps nothing between steps; its step redraws p − 1 past vectors beside the fresh one: at most one
    release more at its peak than independent noise, whatever p."""
    independent = plan(config("method=dp-adam"))["peak_bytes"]
    size = released_bytes(config("method=dp-adam"))
    peaks = [plan(config("method=dp-adam", *noise("bisr", p)))["peak_bytes"] for p in (2, 5)]
    assert peaks[0] == peaks[1] and independent <= peaks[0] <= independent + size


def test_the_plan_gives_the_most_bands_that_fit_and_plans_confirm_it():
    """A budget with room for a few more bands beside dp-adam's whole batch: the row says how many, and a plan at
    that many bands fits it while one with one more does not."""
    cfg = config("method=dp-adam", *noise("bandmf", 3))
    device, size = plan_device("cpu"), released_bytes(cfg)
    whole = plan(cfg, 8, 8, first_micro_batches=2, account=True)
    budget = reserved_estimate(whole["peak_bytes"] + 4.5 * size, cfg.memory.allocator_overhead)
    row = candidate(cfg, budget, device, ("fp32",))
    assert row["fits"] and row["physical_batch_size"] == 8
    bands = row["bands"]
    assert bands["planned"] == 3 and bands["largest"] == 7 and bands["band_bytes"] == size
    for b, fits in ((7, True), (8, False)):
        again = plan(config("method=dp-adam", *noise("bandmf", b)), 8, 8, first_micro_batches=2, account=True)
        assert (again["reserved_estimate_bytes"] <= budget) == fits
    assert [p["fits"] for p in bands["peaks"] if p["bands"] in (4, 8)] == [True, False]
    # at physical batch 1 (the quick plan's one micro-batch), the batch's room holds more
    most = bands["largest_at_1"]
    assert most > 7
    for b, fits in ((most, True), (most + 1, False)):
        again = plan(config("method=dp-adam", *noise("bandmf", b), "memory.steps=2"), 8, 1, first_micro_batches=1)
        assert (again["reserved_estimate_bytes"] <= budget) == fits


def test_dpmem_plan_prints_and_writes_the_bands_that_fit(tmp_path, cli):
    """The CLI: each row's bands in plan.json, the rule beside them, and the line on stderr and in plan.md."""
    out = tmp_path / "plan"
    r = cli("plan", *VIT, *noise("bandmf", 3), 'plan.candidates=["method=dp-adam"]', "plan.checkpointing=[false]",
            "plan.device=cpu", "memory.budget=8MiB", f"plan.dir={out}")
    assert r.returncode == 0, r.stderr
    result = json.loads((out / "plan.json").read_text())
    (row,) = result["rows"]
    assert row["fits"] and row["bands"]["largest"] >= 3 and result["bands_rule"].startswith("bandmf's bands")
    said = f"privacy.bands ≤ {row['bands']['largest']} at physical batch {row['physical_batch_size']}"
    assert said in r.stderr and said in (out / "plan.md").read_text()


def test_where_no_bands_fit_the_refusal_says_how_many_would():
    """A budget that only fewer bands fit, at physical batch 1: nothing fits, and the one-line refusal names the
    bands that would."""
    cfg = config("method=dp-adam", *noise("bandmf", 12))
    device, size = plan_device("cpu"), released_bytes(cfg)
    one = plan(cfg, 8, 1, first_micro_batches=1, account=True)
    budget = reserved_estimate(one["peak_bytes"] - 6.5 * size, cfg.memory.allocator_overhead)
    row = candidate(cfg, budget, device, ("fp32",))
    assert not row["fits"] and row["bands"]["largest"] == 5
    error = nothing_fits([{**row, "configuration": "method=dp-adam"}], budget)
    assert error.key == "memory.budget" and "privacy.bands ≤ 5 (not 12)" in str(error)


def test_a_cpu_runs_reported_peak_holds_all_of_bandmfs_buffers(tmp_path):
    """A run's own meter (logging.memory_steps on the CPU) counts from the step where bandmf holds its b − 1
    buffers, not from the second: with 2 metered steps it would have seen two buffers of five."""
    from dpmem.engine.trainer import run_training
    common = ["method=dp-adam", "train.steps=9", "logging.memory_steps=2", "train.device=cpu", "privacy.epsilon=8",
              "data.image_size=8", "model.arch.patch_size=4", "model.arch.hidden_size=16",
              "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2", "model.arch.intermediate_size=32",
              "train.static_shapes=true", "privacy.sampler_seed=1"]  # every micro-batch one shape: one activation peak
    peaks = {}
    for name, more in (("independent", []), ("bandmf", noise("bandmf", 6))):
        peaks[name] = run_training(config(*common, *more), tmp_path / name)["peak_memory_bytes"]
    # b − 1 = 5 buffers beside what independent noise holds, less about one release: independent noise's own draw
    # is live at its peak (from the second step the meter saw 2 bands more, not 4)
    assert peaks["bandmf"] - peaks["independent"] >= 4 * released_bytes(config(*common))
