"""Activation checkpointing with per-sample work: the recompute in the backward pass runs dpmem's hooks again, and
per-sample gradients, clipped steps and plans must come out as without it, with less activation memory."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from dpmem.composition import CONF_DIR
from dpmem.engine.planner import plan
from dpmem.methods import build_method, method_config
from dpmem.models import checkpoint_activations
from dpmem.persample import Taps
from dpmem.persample.factored import Factored
from dpmem.privacy.mechanism import GaussianMechanism
from tiny_models import tiny_llama, tiny_opt, tiny_roberta, tiny_vit
from helpers import seeded


MODELS = {"roberta-mlm": tiny_roberta, "opt": tiny_opt, "llama": tiny_llama, "vit": lambda: tiny_vit("eager")}


def case(name, checkpointing):
    torch.manual_seed(0)
    model, loss, batch = MODELS[name]()
    model = model.double().train()
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    if checkpointing:
        checkpoint_activations(model)
    return model, loss, batch


def blocks_run(model) -> list[int]:
    """Counts the forward calls of each block's first Linear: 2 per step under checkpointing (the block's own
    hooks stay outside Hugging Face's checkpoint; its layers' run again)."""
    calls = []
    layers = next(m for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList))
    for layer in layers:
        calls.append(0)
        first = next(m for m in layer.modules() if isinstance(m, torch.nn.Linear))
        first.register_forward_hook(lambda *_, i=len(calls) - 1: calls.__setitem__(i, calls[i] + 1))
    return calls


def per_sample(name, checkpointing):
    model, loss, batch = case(name, checkpointing)
    calls = blocks_run(model)
    with Taps(model) as taps:
        kept = taps.gradients(lambda: loss(model, batch).sum(), 3)
        names = {p: n for n, p in model.named_parameters()}
        grads = {names[p]: g.to_dense() if isinstance(g, Factored) else g for p, g in kept.items()}
    return grads, calls


@pytest.mark.parametrize("name", MODELS)
def test_per_sample_gradients_equal_the_run_without_checkpointing(name):
    want, calls = per_sample(name, False)
    got, recomputed = per_sample(name, True)
    assert set(calls) == {1} and set(recomputed) == {2}  # each block did run again in the backward pass
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)


METHODS = [("dp-adam", {}), ("dp-adam", {"clipping": "bk"}), ("dp-adam", {"clipping": "ghost"}), ("dp-adam", {"clipping": "mixed"}),
           ("dp-sgd-rc", {"estimator": "hutchpp", "k": 4}), ("galore-dp-naive", {"rank": 2, "refresh": 1}),
           ("grape", {"rank": 2}), ("grape", {"rank": 2, "project_embeddings": True}), ("adam", {})]


@pytest.mark.parametrize("name", ["roberta-mlm", "opt", "llama", "vit"])
@pytest.mark.parametrize("method,options", METHODS, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k}={v}" for k, v in x.items()))
def test_steps_equal_the_run_without_checkpointing(name, method, options):
    """Two steps over two micro-batches with the same noise: norms, clipped sums, noise and updates agree."""
    def params_after(checkpointing):
        model, loss, batch = case(name, checkpointing)
        extra = {"max_grad_norm": 0.5} if method != "adam" else {}
        cfg = method_config(method, **extra, **options)
        noise = GaussianMechanism(1.0, 0.5, 3.0, seeded(7)) if method != "adam" else None
        step = build_method(cfg, model, 0.05, noise, seed=3)
        micro = [{k: v[i::2] for k, v in batch.items()} for i in range(2)]
        for _ in range(2):
            step.step(micro, loss)
        step.close()
        return torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(params_after(True), params_after(False), rtol=1e-9, atol=1e-11)


def config(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=["logging.progress=false", "memory.steps=2", *overrides])


@pytest.mark.parametrize("method", ["grape", "dp-adam", "adam"])
def test_the_planner_plans_checkpointing_below_the_run_without(method):
    """More blocks than the tiny default, so that keeping one block's activations at a time shows."""
    shape = ["model=roberta-tiny", "model.head=mlm", "data=synthetic", "data.seq_len=64", "train.batch_size=8",
             "model.arch.num_hidden_layers=6", f"method={method}"]
    if method == "dp-adam":
        shape.append("method.clipping=ghost")
    without, with_ = plan(config(*shape)), plan(config(*shape, "train.activation_checkpointing=true"))
    assert with_["peak_bytes"] < 0.8 * without["peak_bytes"], (with_["peak_bytes"], without["peak_bytes"])
