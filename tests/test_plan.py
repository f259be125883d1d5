"""dpmem plan (issue 46): the roofline's FLOP counts against closed forms, the private step's extra work against
the per-sample work each method does, and the chosen configuration against its budget and a real run."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dpmem.api import ClippingPlan, GaussianMechanism, Privatizer, build_method, method_config
from dpmem.engine.planner import AttentionKernels
from dpmem.engine.roofline import DEVICES, OpCounter, tensor_bytes

B, T, D, P, H = 3, 5, 16, 24, 2


def counted(fn) -> OpCounter:
    counter = OpCounter(DEVICES["h100"], ("fp32", "tf32"))
    with counter:
        fn()
    return counter


def meta(*shape, grad=True, dtype=torch.float32):
    return torch.randn(*shape, device="meta", dtype=dtype, requires_grad=grad)


def linear_step():
    layer = torch.nn.Linear(D, P, device="meta")
    layer(meta(B, T, D)).sum().backward()


def linear_frozen_input_step():
    layer = torch.nn.Linear(D, P, device="meta")
    layer(meta(B, T, D, grad=False)).sum().backward()


def conv_step():
    conv = torch.nn.Conv2d(3, 8, 3, device="meta")
    conv(meta(B, 3, 10, 10)).sum().backward()


def embedding_step():
    emb = torch.nn.Embedding(50, D, device="meta")
    emb(torch.zeros(B, T, dtype=torch.long, device="meta")).sum().backward()


def attention_step(target):
    def step():
        q, k, v = meta(B, H, T, D), meta(B, H, T, D), meta(B, H, T, D)
        with AttentionKernels(target):
            F.scaled_dot_product_attention(q, k, v).sum().backward()
    return step


CONV_OUT = 8 * 8 * 8  # channels × 8 × 8 output positions
# forward plus backward, each from the textbook: a (m×k)(k×n) product is 2mkn FLOPs; attention's QKᵀ and PV are
# 2·T²·d each per head, its backward four such products, and a fused kernel recomputes QKᵀ in the backward
CLOSED_FORMS = {
    "linear": (linear_step, 3 * 2 * B * T * D * P),  # y = xWᵀ; dx = dy W; dW = dyᵀx
    "linear, input frozen": (linear_frozen_input_step, 2 * 2 * B * T * D * P),
    "conv2d": (conv_step, 3 * 2 * B * CONV_OUT * 3 * 9),  # each output: a 3·3·3 patch; dx and dW the same count
    "embedding": (embedding_step, B * T * D),  # a gather, then one add per gradient element into its row
    "attention, math": (attention_step(None), 12 * B * H * T * T * D),
    "attention, cuda kernel": (attention_step("cuda"), 14 * B * H * T * T * D),
    "attention, cpu kernel": (attention_step("cpu"), 14 * B * H * T * T * D),
}


@pytest.mark.parametrize("name", list(CLOSED_FORMS))
def test_counted_flops_of_forward_and_backward_equal_the_closed_form(name):
    step, flops = CLOSED_FORMS[name]
    assert counted(step).flops == flops


def test_bytes_are_each_tensor_read_and_written_once_and_views_move_none():
    x, y = meta(64, 32, grad=False), meta(64, 32, grad=False)
    c = counted(lambda: (x + y).t().contiguous())  # add: reads 2, writes 1; t: a view; contiguous: a copy
    assert c.bytes == 3 * x.nbytes + 2 * x.nbytes
    assert tensor_bytes(x[:1].expand(64, 32)) == 32 * 4  # a broadcast row is read once
    assert c.flops == 0 and c.seconds["fp32"] == pytest.approx(c.bytes / (DEVICES["h100"].bandwidth_gbs * 1e9))


def test_tf32_speeds_up_matmuls_and_not_attention_or_elementwise_ops():
    a, b = meta(4096, 4096, grad=False), meta(4096, 4096, grad=False)
    mm = counted(lambda: a @ b)  # compute-bound: 2·4096³ FLOPs over 3·64 MiB
    h100 = DEVICES["h100"]
    assert mm.seconds["fp32"] == pytest.approx(2 * 4096**3 / (h100.fp32_tflops * 1e12))
    assert mm.seconds["tf32"] == pytest.approx(2 * 4096**3 / (h100.tf32_tflops * 1e12))
    attention = counted(attention_step("cuda"))
    assert attention.seconds["tf32"] == attention.seconds["fp32"] >= attention.flops / (h100.fp32_tflops * 1e12)


def one_linear(d, p, bias=False):
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(d, p, bias=bias)), {"x": torch.randn(B, T, d)}


def squared_output(model, batch):
    return model(batch["x"]).pow(2).sum((1, 2))  # per-sample losses; no matmul beyond the layer's


def step_flops(method: str, d: int, p: int, **options) -> int:
    """The FLOPs of a method's second step (the first makes its state) on one Linear(d, p) at (B, T, d)."""
    model, batch = one_linear(d, p)
    noise = GaussianMechanism(1.0, 1.0, float(B), None) if method != "adam" else None
    step = build_method(method_config(method, **options), model, 0.1, noise)
    step.step([batch], squared_output)
    return counted(lambda: step.step([batch], squared_output)).flops


@pytest.mark.parametrize("d,p", [(16, 32), (4, 3)])  # ghost is cheaper (2T² < dp); per-sample products are
def test_bk_does_the_non_private_step_plus_its_per_sample_norms(d, p):
    """bk's clipped sum (c ⊙ G)ᵀA costs the weight gradient's product; its norms add, per layer, the Gram matrices
    GGᵀ and AAᵀ (2·B·T²·(d + p)) or the per-sample products GᵢᵀAᵢ (2·B·T·d·p), whichever is smaller."""
    extra = step_flops("dp-adam", d, p, clipping="bk") - step_flops("adam", d, p)
    assert extra == min(2 * B * T * T * (d + p), 2 * B * T * d * p)


def test_grape_replaces_the_weight_gradient_with_its_projections():
    """grape: the forward, then per sample the smaller side projected (2·B·T·s·r), its product with the other side
    (2·B·T·l·r), the clipped sum of the (l × r) projections (2·B·l·r), and the update lifted back (2·d·p·r)."""
    d, p, r = 16, 32, 2
    s, l = min(d, p), max(d, p)
    forward = 2 * B * T * d * p
    assert step_flops("grape", d, p, rank=r, projected=["0"]) == (
        forward + 2 * B * T * s * r + 2 * B * T * l * r + 2 * B * l * r + 2 * d * p * r)


def test_a_private_step_through_the_privatizer_counts_as_its_method():
    model, batch = one_linear(D, P)
    private = Privatizer(model, GaussianMechanism(1.0, 1.0, float(B), None), ClippingPlan.of("ghost"))
    shapes = {q: q.shape for q in private.params}
    private.gradient([batch], squared_output, shapes)  # the first step checks coverage with a full backward
    c = counted(lambda: private.gradient([batch], squared_output, shapes))
    # two passes over one graph: the forward, the Grams for the norms, and autograd's clipped sum Σᵢ cᵢ gᵢ
    assert c.flops == 2 * B * T * D * P + 2 * B * T * T * (D + P) + 2 * B * T * D * P


TINY = ["model=roberta-tiny", "data=synthetic", "data.seq_len=16", "train.batch_size=32", "train.steps=20",
        "train.device=cpu", "logging.progress=false"]
CANDIDATES = 'plan.candidates=["method=dp-adam method.clipping=materialize","method=grape","method=dp-adam"]'


@pytest.mark.long
def test_the_chosen_configuration_fits_its_budget_and_trains(tmp_path, cli):
    """A budget between what materialize needs at physical batch 1 and at 32: the plan picks a physical batch that
    fits, on the cpu plan.device (exact bytes, CPU kernels), and its first command trains."""
    out = tmp_path / "plan"
    r = cli("plan", *TINY, CANDIDATES, "plan.checkpointing=[false]", "plan.device=cpu", "memory.budget=3MiB",
            f"plan.dir={out}")
    assert r.returncode == 0, r.stderr
    plan = json.loads((out / "plan.json").read_text())
    fitting = [row for row in plan["rows"] if row["fits"]]
    assert fitting and all(row["reserved_estimate_bytes"] <= 3 * 2**20 for row in fitting)
    assert any(row["physical_batch_size"] < 32 for row in fitting)  # the budget bound somewhere
    assert [row["samples_per_s"] for row in fitting] == sorted((row["samples_per_s"] for row in fitting),
                                                               reverse=True)
    assert {"plan.md", "plan.png", "plan.pdf"} <= {p.name for p in out.iterdir()}
    assert "estimates from a roofline, not measurements" in (out / "plan.md").read_text()
    best = fitting[0]
    assert best["sigma"] > 0 and best["epsilon"] == 8
    command = best["command"].split()
    assert command[:2] == ["dpmem", "train"] and f"train.physical_batch_size={best['physical_batch_size']}" in command
    run = tmp_path / "run"
    trained = cli(*command[1:], "train.steps=2", f"hydra.run.dir={run}")
    assert trained.returncode == 0, trained.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["physical_batch_size"] == best["physical_batch_size"]


def test_a_budget_nothing_fits_is_one_line_naming_the_smallest_peak(tmp_path, cli):
    r = cli("plan", *TINY, CANDIDATES, "plan.checkpointing=[false]", "plan.device=cpu", "memory.budget=100KiB",
            f"plan.dir={tmp_path / 'plan'}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines[-1].startswith("dpmem: error: memory.budget")
    assert "nothing fits" in lines[-1] and "the smallest peak is" in lines[-1] and "physical batch 1" in lines[-1]
    assert not (tmp_path / "plan").exists()


@pytest.mark.parametrize("overrides,key", [(["method=dp-adam,grape"], "override"),
                                           (["plan.precisions=[bf16]"], "plan.precisions"),
                                           (["plan.candidates=[]"], "plan.candidates"),
                                           (["plan.device=v100"], "plan.device"),
                                           (["memory.device=cpu"], "memory.device"),
                                           (["plan.checkpointing=[]"], "plan.checkpointing"),
                                           (["plan.precisions=[]"], "plan.precisions"),
                                           (["plan.top=0"], "plan.top"), (["plan.top=-1"], "plan.top"),
                                           # the base configuration's own mistake, under its own key
                                           ([CANDIDATES, "train.precision=bf16"], "train.precision"),
                                           ([CANDIDATES, "data=npz"], "data.path"),
                                           ([CANDIDATES, "train.batch_size=5000"], "train.batch_size")])
def test_what_cannot_be_planned_is_refused_in_one_line(tmp_path, cli, overrides, key):
    r = cli("plan", *TINY, *overrides, f"plan.dir={tmp_path / 'plan'}")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"dpmem: error: {key}"), r.stderr


def test_any_train_override_is_a_candidate_and_a_refused_one_says_why(tmp_path, cli):
    """LoRA adapters and grape's rank as candidates; a rank grape refuses (at least every layer's smaller side) is
    listed as not planned, with dpmem train's own reason."""
    out = tmp_path / "plan"
    r = cli("plan", *TINY, 'plan.candidates=["method=dp-adam model.lora.r=4","method=grape method.rank=4",'
            '"method=grape method.rank=32"]', "plan.checkpointing=[false]", "plan.device=cpu", f"plan.dir={out}")
    assert r.returncode == 0, r.stderr
    plan = json.loads((out / "plan.json").read_text())
    planned = {row["configuration"] for row in plan["rows"]}
    assert planned == {"method=dp-adam model.lora.r=4 train.activation_checkpointing=false",
                       "method=grape method.rank=4 train.activation_checkpointing=false"}
    (refused,) = plan["refused"]
    assert refused["configuration"].startswith("method=grape method.rank=32") and "method.rank" in refused["why"]
    assert "Not planned" in (out / "plan.md").read_text()


def row(method, samples_per_s, fits=True, peak=1):
    return {"method": method, "samples_per_s": samples_per_s, "fits": fits, "peak_bytes": peak}


def test_the_ranking_puts_first_order_methods_before_faster_zeroth_order_ones_and_the_asked_method_first():
    """Written out by hand: within a family by samples/s, first-order before zeroth-order whatever their speed, the
    method the user named before both, and what does not fit last by its peak."""
    from dpmem.engine.chooser import rank
    rows = [row("dpzero", 900), row("grape", 300), row("dp-adam", 500), row("mezo", 950), row("dp-adam", 10, False, 9),
            row("grape", 10, False, 5), row("dp-sgd-rc", 400)]
    order = [(r["method"], r["samples_per_s"]) for r in rank(rows)]
    assert order == [("dp-adam", 500), ("dp-sgd-rc", 400), ("grape", 300), ("mezo", 950), ("dpzero", 900),
                     ("grape", 10), ("dp-adam", 10)]
    asked = [(r["method"], r["samples_per_s"]) for r in rank(rows, asked="grape")]
    assert asked[:3] == [("grape", 300), ("dp-adam", 500), ("dp-sgd-rc", 400)]


def test_a_forward_only_candidate_is_planned_once_and_the_output_says_how_it_is_ranked(tmp_path, cli):
    """dpzero with and without checkpointing would be two identical rows (no backward pass to recompute): it is
    one, named without checkpointing; grape, first-order, ranks above it whatever the estimates."""
    out = tmp_path / "plan"
    r = cli("plan", *TINY, 'plan.candidates=["method=dpzero","method=grape"]', "plan.checkpointing=[false,true]",
            "plan.device=cpu", f"plan.dir={out}")
    assert r.returncode == 0, r.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert [row["configuration"] for row in plan["rows"] if row["fits"]][-1] == "method=dpzero"
    assert sorted(row["configuration"] for row in plan["rows"]) == [
        "method=dpzero", "method=grape train.activation_checkpointing=false",
        "method=grape train.activation_checkpointing=true"]
    assert "Ranked by estimated samples/s within each family of methods" in r.stdout


def test_a_plan_whose_every_candidate_is_refused_says_why_not_that_nothing_fits(tmp_path, cli):
    """It ended "memory.budget: nothing fits" though no candidate was planned: now each refusal's reason."""
    r = cli("plan", *TINY, 'plan.candidates=["method=grape method.rank=32","method=dp-sgd-rc method.k=0"]',
            "plan.checkpointing=[false]", "plan.device=cpu", f"plan.dir={tmp_path / 'plan'}")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("dpmem: error: plan.candidates: every candidate was refused: "), last
    assert "method=grape method.rank=32 train.activation_checkpointing=false: method.rank: " in last
    assert "method.k: " in last and "nothing fits" not in last and not (tmp_path / "plan").exists()


def test_a_candidate_listed_twice_is_refused_before_any_is_planned(tmp_path, cli):
    r = cli("plan", *TINY, 'plan.candidates=["method=grape method.rank=4","method=dp-adam",'
            '"method.rank=4  method=grape"]', "plan.device=cpu", f"plan.dir={tmp_path / 'plan'}")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "dpmem: error: plan.candidates: 'method.rank=4  method=grape' is listed twice (first as 'method=grape "
        "method.rank=4'): each candidate is planned once; remove the repeat"), r.stderr
    assert "dpmem plan: method" not in r.stderr  # refused before any candidate was planned
