"""On a CUDA GPU (skipped without one): clipped sums equal the CPU's, every method trains in fp32, tf32 and bf16, a
checkpoint written on CUDA resumes there and on the CPU, the memory plan is within 10 % of what CUDA allocates,
and a step compiled with CUDA graphs equals the eager one over several micro-batches."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from dpmem.composition import CONF_DIR
from dpmem.engine.planner import plan
from dpmem.engine.trainer import run_training
from dpmem.methods import METHODS
from dpmem.precision import RunPrecision
from helpers import PRIVATE, dies_at, released
from tiny_models import tiny_roberta, tiny_vit

pytestmark = pytest.mark.cuda

ROBERTA = ["model=roberta-tiny", "data=synthetic", "data.seq_len=16", "train.batch_size=16", "train.steps=3",
           "logging.progress=false", "logging.memory_steps=0", "privacy.epsilon=1"]
METHOD_RUNS = [["method=adam", "privacy=none"], ["method=dp-adam"], ["method=dp-adam", "method.clipping=ghost"],
               ["method=dp-adam", "method.clipping=materialize"], ["method=grape", "method.rank=4"],
               ["method=dp-sgd-rc"], ["method=dp-sgd-rc", "method.bookkeeping=true"],
               ["method=galore-dp-naive", "method.rank=4"], ["method=galore", "method.rank=4", "privacy=none"],
               ["method=dpzero", "train.lr=1e-4"], ["method=mezo", "train.lr=1e-4", "privacy=none"],
               ["method=dp-adam", "train.activation_checkpointing=true", "method.clipping=ghost"],
               ["method=dp-adam", "model.lora.r=4"]]


def config(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=[*ROBERTA, *overrides])


@pytest.fixture
def on_cuda():
    """`released` (tests/test_precision.py) on CUDA: the models and batches it builds moved to the GPU."""
    def moved(make):
        def build():
            model, loss, batch = make()
            return model.cuda(), loss, {k: v.cuda() for k, v in batch.items()}
        return build
    return lambda make, *args: released(moved(make), *args)


@pytest.mark.parametrize("make", [tiny_roberta, tiny_vit], ids=["roberta-mlm-tied", "vit"])
@pytest.mark.parametrize("name,options", PRIVATE, ids=lambda v: v if isinstance(v, str) else "-".join(
    f"{k}={x}" for k, x in v.items()))
def test_clipped_sums_on_cuda_equal_the_cpus(make, name, options, on_cuda):
    """fp32 with TF32 off: the released clipped mean (noise off; C so that some samples clip) on CUDA is the CPU's
    to float32 rounding. Grape's projections and DP-SGD-RC's probes are random draws, which a CUDA generator makes
    differently from a CPU one: those two are compared by the CUDA runs of their own tests."""
    if name in ("grape", "dp-sgd-rc"):
        pytest.skip("its random projections or probes are drawn differently on CUDA")
    with RunPrecision("fp32", torch.device("cuda")):
        gpu, = on_cuda(make, name, options, "fp32", 0.05)
    cpu, = released(make, name, options, "fp32", 0.05)
    assert (gpu.cpu() - cpu).norm() <= 1e-5 * cpu.norm()


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("overrides", METHOD_RUNS, ids=lambda o: " ".join(o))
def test_every_method_trains_on_cuda_in_each_precision(tmp_path, overrides, precision):
    summary = run_training(config("train.device=cuda", f"train.precision={precision}", *overrides), tmp_path)
    assert summary["status"] == "ok" and summary["steps_done"] == 3, summary["error"]
    assert summary["device"].startswith("cuda") and summary["precision"] == precision
    assert summary["peak_memory_source"] != "live_tensors"
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses and all(loss == loss and abs(loss) < 1e6 for loss in losses)


@pytest.mark.parametrize("method", ["dp-adam", "grape", "dpzero"])
@pytest.mark.parametrize("resume_on", ["cuda", "cpu"])
def test_a_checkpoint_written_on_cuda_resumes(tmp_path, monkeypatch, method, resume_on):
    cls = METHODS[method]
    real_step = dies_at(monkeypatch, cls, 3)
    run = ["train.steps=4", "train.checkpoint_every=2", f"method={method}", "privacy.noise_seed=3",
           "privacy.sampler_seed=3"]
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config("train.device=cuda", *run), tmp_path)
    assert (tmp_path / "checkpoint.pt").exists()
    monkeypatch.setattr(cls, "step", real_step)
    summary = run_training(config(f"train.device={resume_on}", *run), tmp_path)
    assert summary["status"] == "ok" and summary["resumed_from_step"] == 2 and summary["steps_done"] == 4
    assert summary["device"].startswith(resume_on)
    # a CUDA generator's state cannot seed a CPU generator: the noise is seeded afresh, and the summary says so
    assert ("noise_reseeded" in summary) == (resume_on == "cpu")


@pytest.mark.parametrize("method", ["adam", "dp-adam", "grape"])
def test_the_memory_plan_is_within_10_percent_of_cuda_allocated(method):
    """A small RoBERTa (roberta-base, 2 blocks, B 16, T 128): the meta plan (target cuda) against
    torch.cuda.max_memory_allocated over the same steps on the GPU."""
    torch.cuda.empty_cache()
    cfg = config(f"method={method}", "model=roberta-base", "model.arch.num_hidden_layers=2", "data.seq_len=128",
                 "memory.target=cuda")
    planned = plan(cfg, device="meta")["peak_bytes"]
    allocated = plan(cfg, device="cuda")["cuda_max_allocated_bytes"]
    assert abs(planned - allocated) <= 0.10 * allocated, (planned, allocated)


@pytest.mark.parametrize("name", ["dp-adam", "grape", "dp-sgd-rc", "dpzero", "adam"])
def test_the_compiled_step_under_cuda_graphs_equals_the_eager_step_over_micro_batches(name):
    """Inductor on CUDA replays CUDA graphs, each replay writing into the same static output buffers: a clipped
    sum (or DPZero's losses) kept from one micro-batch's replay to the next would be overwritten, or counted twice,
    which doubles the sensitivity. Three steps of three micro-batches each (the last padded), float64, compiled
    against eager on the GPU."""
    from test_compile import three_steps
    want, _ = three_steps("roberta-mlm", name, device="cuda", micro_batches=3)
    got, capture = three_steps("roberta-mlm", name, "inductor", device="cuda", micro_batches=3)
    assert capture["graph_breaks"] == 0 and capture["cuda_graphs"], capture
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
