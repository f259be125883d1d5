"""train.compile: the private step's micro-batch (forward, per-sample backward to the taps' probes, norms, clip
factors, clipped sums) compiles as one graph (fullgraph=True: a break is an error), and a compiled step, with its
noise added outside the graph, equals the eager one. Most cases trace with dynamo's eager backend (the whole graph
captured, then run by ATen: seconds, not minutes, on 2 cores); the bf16 case with aot_eager (autocast through
AOTAutograd); one runs inductor's generated code."""

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

from dpmem import compiling
from dpmem.compiling import Compiler
from dpmem.config import ConfigError
from dpmem.data.bundle import Padded
from dpmem.engine.trainer import run_training
from dpmem.methods import build_method, method_config, privatize, validate
from dpmem.methods.base import direct_fused_adam, fused_adam_step, own_step_counts
from dpmem.models import checkpoint_activations
from dpmem.persample import taps
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, seed_key
from helpers import INDUCTOR, config, seeded
from test_lora import roberta_classifier
from tiny_models import tiny_llama, tiny_opt, tiny_roberta, tiny_vit


def small_mlp():
    """An embedding, a LayerNorm and two linear layers: inductor's C++ code for it compiles in seconds."""
    model = nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    loss = lambda m, b: F.cross_entropy(m(b["ids"]).mean(1), b["y"], reduction="none")  # noqa: E731
    return model, loss, {"ids": ids, "y": torch.tensor([0, 2, 1])}


MODELS = {"roberta-mlm": tiny_roberta, "vit": lambda: tiny_vit("eager"), "opt": tiny_opt, "llama": tiny_llama,
          "lora": roberta_classifier, "mlp": small_mlp}
OPTIONS = {"dp-adam": {"clipping": "bk"}, "dp-sgd-materialize": {"clipping": "materialize"}, "grape": {"rank": 2},
           "galore-dp-naive": {"rank": 2, "refresh": 1}, "dp-sgd-rc": {"bookkeeping": True, "k": 4},
           "adam": {}, "dpzero": {}, "mezo": {},
           # two-pass clipping: norms streamed out of the first backward pass, the sums from a second
           "dp-adam-ghost": {"clipping": "ghost"}, "dp-sgd-mixed": {"clipping": "mixed"},
           "dp-sgd-rc-two-pass": {"k": 4}}
PRIVATE = {"dp-adam", "dp-sgd", "grape", "galore-dp-naive", "dp-sgd-rc", "dpzero"}


def case(model_name):
    """A float64 model (dropout off) with its first two parameters frozen (but ViT's, so that its cls token and
    positions take the generic rule's replay), and two micro-batches of 2, the second padded (one real sample)."""
    torch.manual_seed(0)
    model, loss, batch = MODELS[model_name]()
    model = model.double().train()
    for p in list(p for p in model.parameters() if p.requires_grad)[:0 if model_name == "vit" else 2]:
        p.requires_grad_(False)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    micro = [Padded({k: v[:2] for k, v in batch.items()}, 2), Padded({k: v[[2, 2]] for k, v in batch.items()}, 1)]
    return model, loss, micro


def three_steps(model_name, name, backend=None, device="cpu", micro_batches=2, checkpointed=False, tf32=False):
    """The trainable parameters after three steps (eager, or compiled with `backend`) on `device`, each of
    `micro_batches` (2, or 3: the first repeated ahead), and the capture; `checkpointed`: with activation
    checkpointing; `tf32`: compiled as for a TF32 run."""
    model, loss, micro = case(model_name)
    if checkpointed:
        checkpoint_activations(model, compiled=backend is not None)
    micro = [Padded({k: v.to(device) for k, v in mb.items()}, mb.real)
             for mb in micro[:1] * (micro_batches - 2) + micro]
    model = model.to(device)
    options = OPTIONS[name]
    method_name = name.removesuffix("-materialize").removesuffix("-ghost").removesuffix("-mixed").removesuffix(
        "-two-pass")
    private = method_name in PRIVATE
    cfg = method_config(method_name, **options, **({"max_grad_norm": 0.5} if private else {}))
    noise = GaussianMechanism(1.0, 0.5, 3.0, Draws(seed_key(7), "noise", device)) if private else None
    method = build_method(cfg, model, 0.05, noise, seed=3)
    compiler = None
    if backend is not None:
        compiler = Compiler(torch.device(device), backend, tf32)
        method.compile(compiler)
    for _ in range(3):
        method.step(micro, loss)
    method.close()
    trained = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    return trained, None if compiler is None else compiler.capture()


CASES = [(m, n) for m in MODELS if m != "mlp" for n in ("dp-adam", "dp-adam-ghost")] + [
    ("roberta-mlm", n) for n in OPTIONS if n not in ("dp-adam", "dp-adam-ghost")]


@pytest.mark.parametrize("model_name,name", CASES)
def test_the_compiled_step_is_one_graph_per_function_and_equals_the_eager_step(model_name, name):
    want, _ = three_steps(model_name, name)
    got, capture = three_steps(model_name, name, "eager")
    assert capture["graph_breaks"] == 0 and capture["recompiles"] == 0, capture
    assert all(n == 1 for n in capture["graphs_per_function"].values()), capture
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class Logging(nn.Module):
    """A forward that logs (as Longformer's does): dynamo does not trace a Logger's method."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 3)

    def forward(self, ids):
        logging.getLogger("a user's model").warning("a forward that logs")
        return self.head(self.emb(ids).mean(1))


def test_a_step_that_breaks_the_graph_is_refused_in_one_line_before_a_release():
    torch.manual_seed(0)
    model, noise = Logging(), GaussianMechanism(1.0, 0.5, 3.0, seeded(7))
    method = build_method(method_config("dp-adam", max_grad_norm=0.5), model, 0.05, noise)
    method.compile(Compiler(torch.device("cpu"), "eager"))
    batch = Padded({"ids": torch.randint(0, 20, (3, 4)), "y": torch.tensor([0, 2, 1])}, 3)
    loss = lambda m, b: F.cross_entropy(m(b["ids"]), b["y"], reduction="none")  # noqa: E731
    with pytest.raises(ConfigError, match=r"^train\.compile: the step does not trace as one graph \([^\n]+\); this "
                                          r"model trains eager: train\.compile=false$"):
        method.step([batch], loss)
    assert noise.state.noise.count == 0  # nothing released
    method.close()


@pytest.mark.parametrize("estimator", ["hutch", "hutchpp"])
def test_compiled_dp_sgd_rc_gives_each_layer_the_probes_of_the_eager_step(estimator, monkeypatch):
    """An eager backward pass estimates a layer whose output gradient is large as it reaches it (streamed), a small
    one after it; a compiled one, whose graph cannot draw, every layer after it. Each parameter draws its own probes,
    so the order gives no layer another's (it did: this MLP's two 16-wide layers swapped probes and the clip factors
    moved; in `dpmem train`'s ViT, of other widths, the compiled step failed). Six steps: losses and weights."""
    monkeypatch.setattr(taps, "STREAM_MIN_ELEMENTS", 100)  # the first Linear's output (2·4·16) streams, the last's not

    def six_steps(backend):
        model, loss, micro = case("mlp")
        cfg = method_config("dp-sgd-rc", max_grad_norm=0.5, k=2, estimator=estimator)  # k < rank: not exact
        method = build_method(cfg, model, 0.05, GaussianMechanism(1.0, 0.5, 3.0, seeded(7)), seed=3)
        if backend:
            method.compile(Compiler(torch.device("cpu"), backend))
        losses = torch.tensor([float(method.step(micro, loss)) for _ in range(6)], dtype=torch.float64)
        method.close()
        return losses, torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    for got, want in zip(six_steps("eager"), six_steps(None)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("model_name,name", [(m, n) for m in ("vit", "roberta-mlm")
                                             for n in ("dp-adam-ghost", "grape")])
def test_a_checkpointed_models_compiled_forward_is_one_graph_and_equals_the_eager_step(model_name, name):
    """Activation checkpointing: the forward compiled with its taps (AOTAutograd's backward, its partitioner's
    recompute), from the first step's second micro-batch on (the first's eager forward makes its probes)."""
    want, _ = three_steps(model_name, name, checkpointed=True)
    got, capture = three_steps(model_name, name, "aot_eager", checkpointed=True)
    assert capture["graphs_per_function"] == {"forward": 1}, capture
    assert capture["graph_breaks"] == 0, capture
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_checkpointed_compiled_forward_saves_less_for_its_backward(monkeypatch):
    """The partitioner recomputes the checkpointed blocks in the compiled backward: the compiled forward returns
    fewer bytes for it (beside the losses) than the same compiled forward without checkpointing."""
    saved = []

    def forward_compiler(gm, inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved.append(sum(v.numel() * v.element_size() for v in (o.meta.get("val") for o in out if o is not None)
                         if isinstance(v, torch.Tensor)))
        return make_boxed_func(gm.forward)
    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    monkeypatch.setattr(compiling, "BACKENDS", (backend,))
    monkeypatch.setattr(privatize, "checkpointed", lambda model: True)  # the forward compiled alone in both
    ours, _ = three_steps("vit", "dp-adam-ghost", backend, checkpointed=True)
    plain, _ = three_steps("vit", "dp-adam-ghost", backend)
    assert len(saved) == 2 and saved[0] < 0.5 * saved[1], saved
    torch.testing.assert_close(ours, plain, rtol=1e-10, atol=1e-12)


@INDUCTOR
@pytest.mark.parametrize("name,function", [("dp-adam", "microbatch"), ("grape", "microbatch"),
                                           ("dp-adam-ghost", "microbatch"), ("dpzero", "forward")])
def test_inductor_code_equals_the_eager_step(name, function):
    """Inductor's kernels and its C++ wrapper (`Compiler`'s CPU options), for the per-sample step, a projected one,
    a two-pass one and a forward-only one."""
    want, _ = three_steps("mlp", name)
    got, capture = three_steps("mlp", name, "inductor")
    assert capture["graphs_per_function"] == {function: 1}, capture
    assert capture["graph_breaks"] == 0, capture
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_guards_kept_on_the_model_still_recompile():
    """The compiler drops dynamo's guards on the step's owner and model (`compiling._owner_guards_dropped`) but for
    the modules' training flags and the parameters' tensor checks: switching the model to eval, or freezing a
    parameter, after the step compiled makes a new graph rather than replaying the old one."""
    model, loss, micro = case("mlp")
    model = nn.Sequential(*model[:4], nn.Dropout(0.0), model[4])  # a module whose forward reads `training`
    method = build_method(method_config("dp-adam", clipping="bk", max_grad_norm=0.5), model, 0.05,
                          GaussianMechanism(1.0, 0.5, 3.0, seeded(7)), seed=3)
    compiler = Compiler(torch.device("cpu"), "eager")
    method.compile(compiler)
    for _ in range(3):  # the eager coverage check, the step that compiles, one replay
        method.step(micro, loss)
    assert compiler.capture()["graphs_per_function"]["microbatch"] == 1
    model.eval()
    method.step(micro, loss)
    assert compiler.capture()["graphs_per_function"]["microbatch"] == 2
    model.train()
    method.step(micro, loss)  # the training graph again, no third one
    assert compiler.capture()["graphs_per_function"]["microbatch"] == 2
    model[2].bias.requires_grad_(False)
    method.step(micro, loss)
    assert compiler.capture()["graphs_per_function"]["microbatch"] == 3
    method.close()


def test_the_noise_is_drawn_outside_the_graph_and_fresh_at_every_step():
    """Two steps on the same batch with lr 0 release different noise (no seed baked into a graph), each the draw
    the eager step makes from the same key."""
    def releases(backend):
        model, loss, micro = case("roberta-mlm")
        method = build_method(method_config("dp-sgd", clipping="bk", max_grad_norm=0.5), model, 0.0,
                              GaussianMechanism(1.0, 0.5, 3.0, seeded(7)))
        if backend:
            method.compile(Compiler(torch.device("cpu"), backend))
        return [torch.cat([g.flatten() for g in method.privatizer.gradient(micro, loss, {p: p.shape for p in
                                                                                       method.params})[0].values()])
                for _ in range(2)]
    eager, compiled = releases(None), releases("eager")
    assert (compiled[0] - compiled[1]).abs().max() > 0.1
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def run(tmp_path, name, *overrides, model=("model=vit-tiny", "data.image_size=8")):
    cfg = config(*model, "data.n_train=64", "train.batch_size=16", "train.physical_batch_size=8",
                 "train.device=cpu", "privacy=eps8", *overrides)
    return run_training(cfg, tmp_path / name)


def test_a_compiled_run_with_dropout_trains_spends_and_reports_as_the_eager_one(tmp_path):
    """Five steps of Poisson sampling, dropout on: one graph per function, no recompile (static shapes: every
    batch size is padded to the physical one). The compiled graph draws its own masks (not the eager run's), so the
    weights differ; ε, the steps and what the summary reports do not."""
    roberta = ("model=roberta-tiny", "data=synthetic", "data.seq_len=8")  # Hugging Face's dropout: 0.1
    eager = run(tmp_path, "eager", "train.static_shapes=true", model=roberta)
    compiled = run(tmp_path, "compiled", "train.compile=true", "train.compile_backend=eager", model=roberta)
    assert eager["status"] == compiled["status"] == "ok"
    assert compiled["epsilon_spent"] == eager["epsilon_spent"] and compiled["steps_done"] == eager["steps_done"]
    assert math.isfinite(compiled["train_loss"]) and compiled["metric_final"] is not None
    assert set(eager) <= set(compiled)
    capture = json.loads((tmp_path / "compiled" / "summary.json").read_text())["compiled"]
    assert capture["graphs_per_function"] == {"microbatch": 1}, capture
    assert capture["graph_breaks"] == 0 and capture["recompiles"] == 0 and capture["compile_seconds"] > 0


def test_a_compiled_checkpointed_run_with_dropout_trains_and_spends_as_the_eager_one(tmp_path):
    """Activation checkpointing in a run (dropout on, two-pass clipping, the model built by the trainer): the
    forward compiled alone, one graph, no recompile, and ε as the eager run's."""
    roberta = ("model=roberta-tiny", "data=synthetic", "data.seq_len=8")
    ghost = ("method=dp-adam", "method.clipping=ghost", "train.activation_checkpointing=true")
    eager = run(tmp_path, "eager", "train.static_shapes=true", *ghost, model=roberta)
    compiled = run(tmp_path, "compiled", "train.compile=true", "train.compile_backend=aot_eager", *ghost,
                   model=roberta)
    assert eager["status"] == compiled["status"] == "ok", compiled.get("error")
    assert compiled["epsilon_spent"] == eager["epsilon_spent"] and compiled["steps_done"] == eager["steps_done"]
    assert math.isfinite(compiled["train_loss"])
    capture = json.loads((tmp_path / "compiled" / "summary.json").read_text())["compiled"]
    assert capture["graphs_per_function"] == {"forward": 1}, capture
    assert capture["graph_breaks"] == 0 and capture["recompiles"] == 0


@pytest.mark.parametrize("model_name,name,checkpointed", [
    ("roberta-mlm", "dp-adam", False), ("roberta-mlm", "dp-adam-ghost", False), ("roberta-mlm", "grape", False),
    ("vit", "dp-adam-ghost", True)])
def test_a_tf32_compiled_step_reduces_after_its_backward_and_equals_the_eager_step(model_name, name, checkpointed,
                                                                                     monkeypatch):
    """TF32, with the compiler's flag standing in (the CPU has none): a graph keeps the TF32 mode it was compiled
    in, so the forward is compiled alone and its backward reduces nothing (no layer's values stream out of it);
    the layers come out whole (or as pairs, checkpointed) and are reduced eagerly, where TF32 is switched off."""
    streams = []  # each recorded forward's streams: True where a layer's values stream, False for a pair
    start = taps.Taps.start

    def recorded(self, *args):
        tape = start(self, *args)
        streams.append([kinds is not None for kinds, _ in tape.streams.values()])
        return tape
    monkeypatch.setattr(taps.Taps, "start", recorded)
    want, _ = three_steps(model_name, name, checkpointed=checkpointed)
    assert any(map(any, streams))  # the eager step streams values
    streams.clear()
    got, capture = three_steps(model_name, name, "aot_eager", checkpointed=checkpointed, tf32=True)
    assert capture["graphs_per_function"] == {"forward": 1} and capture["graph_breaks"] == 0, capture
    assert not any(map(any, streams)), streams
    assert any(map(len, streams)) == checkpointed, streams  # checkpointed: pairs stream (the inputs dropped)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("override,why", [("method=galore", "has no compiled step")])
def test_what_stays_eager_is_refused_in_one_line(override, why):
    cfg = config("model=vit-tiny", "data.image_size=8", "train.compile=true", *override.split())
    with pytest.raises(ConfigError, match=why):
        validate(cfg)


def test_a_bf16_compiled_step_keeps_the_private_arithmetic_in_float32_and_equals_eager():
    """bf16 autocast reaches the forward only: the compiled graph turns it off around norms and clipped sums, as the
    eager step does, so the two agree to bf16's rounding of the forward."""
    from dpmem.precision import RunPrecision

    def steps(backend):
        torch.manual_seed(0)
        model, loss, batch = tiny_roberta()
        method = build_method(method_config("dp-adam", clipping="bk", max_grad_norm=0.5), model, 0.05,
                              GaussianMechanism(1.0, 0.5, 3.0, seeded(7)))
        if backend:
            method.compile(Compiler(torch.device("cpu"), backend))
        forward = RunPrecision("bf16", torch.device("cpu")).forward(loss)
        micro = [Padded({k: v[:2] for k, v in batch.items()}, 2), Padded({k: v[[2, 2]] for k, v in batch.items()}, 1)]
        for _ in range(2):
            method.step(micro, forward)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        return torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(steps("aot_eager"), steps(None), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls,decay", [(torch.optim.Adam, 0.0), (torch.optim.Adam, 0.1), (torch.optim.AdamW, 0.1)])
def test_the_compiled_steps_direct_update_is_torchs_fused_optimizer_step(cls, decay):
    """`fused_adam_step` (a compiled dp-adam's update once its state exists) against torch's own fused step on the
    same gradients: the same parameters and state, bit for bit; and torch's own step after it counts as before."""
    torch.manual_seed(0)
    theirs = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
    ours = [p.detach().clone().requires_grad_() for p in theirs]
    reference, direct = (cls(ps, lr=0.1, weight_decay=decay, fused=True) for ps in (theirs, ours))
    for step in range(3):
        grads = [torch.randn_like(p) for p in theirs]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        reference.step()
        if step == 0:  # the state is made by a first step of torch's (a compiled run's eager first step)
            assert not direct_fused_adam(direct)
            for p, g in zip(ours, grads):
                p.grad = g.clone()
            direct.step()
            direct.zero_grad(set_to_none=True)
        else:
            assert direct_fused_adam(direct)
            fused_adam_step(direct, grads)
    assert direct.state[ours[0]]["step"] is direct.state[ours[1]]["step"]  # one count, added to once a step
    direct.register_step_pre_hook(own_step_counts)  # as a compiled dp-adam has it
    for optimizer, params in ((reference, theirs), (direct, ours)):  # then torch's step again: counts its own
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for p, q in zip(theirs, ours):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(reference.state[p][key], direct.state[q][key])
    assert direct.state[ours[0]]["step"] is not direct.state[ours[1]]["step"]
    assert float(direct.state[ours[1]]["step"]) == 4
