"""Compute precision (dpmem.precision): a bf16 step of every private method equals its fp32 step to the bf16
tolerance, clipped per-sample norms stay at most C to the stated tolerance, the tolerance function rounds as TF32
does, the coverage check tells rounding from a missing use, and `train.precision` refuses what a device cannot do."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from dpmem.composition import CONF_DIR
from dpmem.engine.trainer import run_training
from dpmem.methods.attribution import verify_attribution
from dpmem.persample import Taps, weighted_sum
from dpmem.precision import Compute, exact_float32, tolerance, unit_roundoff
from helpers import PRIVATE, released
from tiny_models import tiny_roberta, tiny_vit

TWO_PASS = ("ghost", "mixed", "fgc")


@pytest.mark.parametrize("make", [tiny_roberta, tiny_vit], ids=["roberta-mlm-tied", "vit"])
@pytest.mark.parametrize("name,options", PRIVATE, ids=lambda v: v if isinstance(v, str) else "-".join(
    f"{k}={x}" for k, x in v.items()))
def test_a_bf16_step_equals_the_fp32_step_to_the_bf16_tolerance(make, name, options):
    """C large (nothing clipped): the released gradient differs by the bf16 forward's rounding only. Measured
    5e-3 (RoBERTa) and 3e-3 (ViT) against the tolerance 6.3e-2."""
    fp32, = released(make, name, options, "fp32", 100.0)
    bf16, = released(make, name, options, "bf16", 100.0)
    assert not torch.equal(fp32, bf16)  # the bf16 forward did run in bf16
    assert (bf16 - fp32).norm() <= tolerance(torch.bfloat16) * fp32.norm()


@pytest.mark.parametrize("make", [tiny_roberta, tiny_vit], ids=["roberta-mlm-tied", "vit"])
@pytest.mark.parametrize("name,options", [c for c in PRIVATE if c[0] != "dp-sgd-rc"], ids=lambda v: v if isinstance(
    v, str) else "-".join(f"{k}={x}" for k, x in v.items()))
def test_bf16_clipped_per_sample_norms_stay_at_most_c(make, name, options):
    """Each sample alone with C far below its norm: what is released is its clipped gradient (projected, for
    grape). One-pass clipping norms and sums it in float32, so ‖clipped gᵢ‖ ≤ C to float32's tolerance; two-pass
    clipping's second backward runs in bf16, so to bf16's (measured 1.3e-3). (DP-SGD-RC clips to C by its
    estimated norm, not the exact one: its bound is the rc accountant's business.)"""
    C = 1e-3
    two_pass = options.get("clipping") in TWO_PASS
    slack = tolerance(torch.bfloat16) if two_pass else tolerance(torch.float32)
    norms = torch.stack([g.norm() for g in released(make, name, options, "bf16", C, samples=range(3))])
    assert (norms <= C * (1 + slack)).all(), norms / C - 1
    assert (norms >= C * (1 - slack)).all()  # every sample was clipped, to C


def tf32_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to TF32 (10 stored significand bits) to nearest, ties away: what an Ampere tensor core reads."""
    bits = x.view(torch.int32)
    return ((bits + (1 << 12)) & ~((1 << 13) - 1)).view(torch.float32)


def test_the_unit_roundoff_of_tf32_is_that_of_a_10_bit_mantissa():
    x = torch.randn(100_000) * torch.logspace(-3, 3, 100_000)
    relative = ((tf32_round(x) - x) / x).abs()
    u = unit_roundoff(torch.float32, tf32=True)
    assert u == 2.0 ** -11 and relative.max() <= u and relative.max() > 0.9 * u
    assert unit_roundoff(torch.float32) == 2.0 ** -24 and unit_roundoff(torch.bfloat16) == 2.0 ** -8
    assert tolerance(torch.float32, tf32=True) == 16 * u
    assert tolerance(torch.bfloat16) > tolerance(torch.float32, tf32=True) > tolerance(torch.float32)
    assert Compute().lowered(torch.bfloat16).dtype == torch.bfloat16
    assert Compute(torch.bfloat16).lowered(torch.float32).dtype == torch.bfloat16
    assert Compute(tf32=True).name == "tf32" and Compute(torch.bfloat16, tf32=True).name == "bfloat16"


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 3)

    def forward(self, x):
        return self.b(self.a(x).tanh())


def coverage_case(batch_gradient):
    """The per-sample sums of a two-layer net, checked against `batch_gradient(model, x, p, exact batch gradient)`
    put in `.grad`."""
    torch.manual_seed(0)
    model, x = TwoLinear(), torch.randn(32, 16, 64)
    taps = Taps(model)
    with taps.recording(taps.zero(), 32) as tape:
        loss = model(x).pow(2).sum((1, 2)).sum()
    kept, grads = taps.per_sample(tape, loss, batch_gradients=True)
    totals = weighted_sum(dict(kept), torch.ones(32))
    for p in taps.parameters:
        p.grad = batch_gradient(model, x, p, grads[p])
    return model, taps.parameters, totals


def tf32_weight_gradient(model, x, p, exact):
    """`a.weight`'s batch gradient GᵀA from TF32-rounded inputs, as a GPU with TF32 on forms it."""
    if p is not model.a.weight:
        return exact
    h = model.a(x).detach().requires_grad_()
    out_grad, = torch.autograd.grad(model.b(h.tanh()).pow(2).sum(), h)
    return tf32_round(out_grad).flatten(0, 1).T @ tf32_round(x).flatten(0, 1)


def test_the_attribution_proof_takes_tf32_rounding_as_rounding(capsys):
    """TF32's rounding of the batch gradient passes silently under TF32's tolerance."""
    model, params, totals = coverage_case(tf32_weight_gradient)
    assert not torch.equal(totals[model.a.weight], model.a.weight.grad)
    verify_attribution(model, params, totals, compute=Compute(tf32=True))
    assert "warning" not in capsys.readouterr().err


def test_the_attribution_proof_calls_rounding_rounding_and_names_the_module_otherwise(capsys):
    tol = 4 * Compute(torch.bfloat16).unit_roundoff
    model, params, totals = coverage_case(lambda model, x, p, g: g * (1 + 2 * tol))  # a few tolerances off
    verify_attribution(model, params, totals, compute=Compute(torch.bfloat16))
    err = capsys.readouterr().err
    assert "rounding" in err and "used outside" not in err
    model, params, totals = coverage_case(lambda model, x, p, g: g * 1.5 if p is model.a.weight else g)
    with pytest.raises(RuntimeError, match=r"a\.weight.*used outside the module"):  # a use the rule missed
        verify_attribution(model, params, totals, compute=Compute(torch.bfloat16))


def test_exact_float32_turns_autocast_and_tf32_off_and_restores_them():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = torch.randn(8, 8)
            assert (a @ a).dtype == torch.bfloat16
            with exact_float32(torch.device("cpu")):
                assert (a @ a).dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
            assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("override,allowed", [("train.precision=tf32", "fp32, bf16"),
                                              ("train.precision=fp16", "fp32")])
def test_a_precision_the_device_cannot_do_is_one_line(cli, tmp_path, override, allowed):
    r = cli("train", "train.device=cpu", override, "train.steps=1", f"hydra.run.dir={tmp_path}/run")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "train.precision" in lines[0] and allowed in lines[0], r.stderr


BF16_RUNS = {"checkpointing-ghost": ["method=dp-adam", "train.activation_checkpointing=true", "method.clipping=ghost"],
             "checkpointing-grape": ["method=grape", "method.rank=4", "train.activation_checkpointing=true"],
             "lora": ["method=dp-adam", "model.lora.r=4"]}


@pytest.mark.parametrize("overrides", BF16_RUNS.values(), ids=BF16_RUNS.keys())
def test_bf16_trains_with_activation_checkpointing_and_lora_on_the_cpu(tmp_path, overrides):
    """bf16 autocast on the CPU, through `dpmem train`: the recompute of a checkpointed block runs under the forward's
    autocast, and the coverage check (on) passes."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["model=roberta-tiny", "data=synthetic", "data.seq_len=12", "train.steps=2",
                                           "train.batch_size=8", "logging.progress=false", "train.device=cpu",
                                           "privacy.epsilon=1", "train.precision=bf16", *overrides])
    summary = run_training(cfg, tmp_path)
    assert summary["status"] == "ok" and summary["precision"] == "bf16", summary["error"]
