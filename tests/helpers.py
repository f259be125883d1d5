"""Helpers that several test modules share: small models with a batch and a per-sample loss, oracles, configs
and spies, and the scripts run in this process. (Tiny Hugging Face models are in `tiny_models`, text data in
`text_fixtures`.)"""

import contextlib
import copy
import functools
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.pytorch_utils import Conv1D

from dpmem.composition import CONF_DIR
from dpmem.methods import build_method, method_config
from dpmem.methods.privatize import Privatizer
from dpmem.persample import Taps
from dpmem.persample.factored import Factored
from dpmem.precision import RunPrecision
from dpmem.privacy.mechanism import NOISE_BUCKET, GaussianMechanism
from dpmem.privacy.randomness import Draws, seed_key
from tiny_models import tiny_roberta, tiny_vit

# the tests that run inductor's C++ code share one xdist worker: on an empty inductor cache the first compile in a
# process pays about 12 CPU-s (its C++ prefix) that every later one there reuses
INDUCTOR = pytest.mark.xdist_group("inductor")

# -- Layers: every layer rule, an embedding with padding and a tied head (two-pass and book-keeping clipping)
B = 5  # the batch size of `layers_batch`


class Layers(nn.Module):
    """A 2-D Linear, a 3-D Linear, Conv1D, Conv2d, an Embedding with repeats and padding, and a tied LM head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 6, padding_idx=0)
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.flat = nn.Linear(3 * 16, 6)
        self.tokens = nn.Linear(6, 6)
        self.gpt = Conv1D(6, 6)
        self.head = nn.Linear(6, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, ids):
        image = self.flat(self.conv(x).tanh().flatten(1))  # (B, 6): a 2-D input
        h = self.tokens(self.emb(ids)).tanh() + image.unsqueeze(1)  # (B, T, 6): a 3-D input
        return self.head(self.gpt(h).tanh())


def layers_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 5, (B, 7), generator=g)
    ids[0, 5:] = 0  # padding
    return {"x": torch.randn(B, 1, 4, 4, generator=g, dtype=torch.float64) * torch.linspace(0.2, 4, B).view(-1, 1, 1, 1),
            "ids": ids, "y": torch.randint(0, 12, (B, 7), generator=g)}


def layers_loss(model, b):
    logits = model(b["x"], b["ids"])
    return F.cross_entropy(logits.transpose(1, 2), b["y"], reduction="none").sum(1)


def method_cfg(name="dp-adam", optimizer="adam", clipping="materialize", k=32):
    if name == "galore-dp-naive":
        return method_config(name, max_grad_norm=0.5, clipping=clipping, rank=4, refresh=10)
    if name == "dp-sgd-rc":
        return method_config(name, max_grad_norm=0.5, optimizer=optimizer, k=k)
    return method_config(name, max_grad_norm=0.5, optimizer=optimizer, clipping=clipping)


def roberta_case():
    model, loss, b = tiny_roberta()
    return model.double(), loss, b


def layers_case():
    return Layers().double(), layers_loss, layers_batch()


def vit_case():
    model, loss, b = tiny_vit(attn="eager")
    return model.double(), loss, {k: v.double() if v.is_floating_point() else v for k, v in b.items()}


def run_steps(make, cls, cfg, steps=2, chunks=2, sigma=1.0):
    torch.manual_seed(0)
    model, loss, b = make()
    method = cls(model, cfg, lr=0.05, mechanism=GaussianMechanism(sigma, 0.5, 3.0, seeded(7)))
    n = len(next(iter(b.values())))
    micro = [{k: v[i::chunks] for k, v in b.items()} for i in range(min(chunks, n))]
    for _ in range(steps):
        method.step(micro, loss)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# -- Mixer: layers projected on either side (DP-GRAPE, GaLore)
def grape_cfg(rank=2, refresh=2, projected=None, C=1.0, name="grape"):
    """The config of grape (or of galore, galore-dp-naive, dp-adam: each with the options it has)."""
    options = {} if name == "dp-adam" else {"rank": rank, "refresh": refresh, "projected": projected}
    if name != "galore":
        options["max_grad_norm"] = C
    return method_config(name, **options)


class Mixer(nn.Module):
    """Linear and Conv1D layers that are wide and tall (both projection sides), a LayerNorm and a head."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(5, 9)  # out > in: columns projected
        self.down = nn.Linear(9, 4)  # out < in: rows projected
        self.conv_wide = Conv1D(7, 4)  # weight (4, 7): rows projected
        self.conv_tall = Conv1D(3, 7)  # weight (7, 3): columns projected
        self.norm = nn.LayerNorm(3)
        self.classifier = nn.Linear(3, 2)

    def forward(self, x):
        h = self.down(self.up(x).tanh()).tanh()
        h = self.conv_tall(self.conv_wide(h).tanh())
        return self.classifier(self.norm(h).mean(1))


def mixer_batch(size=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(size, 4, 5, generator=g) * torch.linspace(0.2, 3, size).view(-1, 1, 1),
            "y": torch.randint(0, 2, (size,), generator=g)}


def mixer_loss(model, b):
    return F.cross_entropy(model(b["x"]), b["y"], reduction="none")


# -- per-sample gradients against a loop of one backward per sample
def engine_grads(model, loss_fn, batch):
    with Taps(model) as taps:
        grads = taps.gradients(lambda: loss_fn(model, batch).sum(), next(iter(batch.values())).shape[0])
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: g.to_dense() if isinstance(g, Factored) else g for p, g in grads.items()}


def loop_grads(model, loss_fn, batch, size):
    """The oracle: one forward/backward per sample, batch of one."""
    per = {}
    for i in range(size):
        model.zero_grad(set_to_none=True)
        one = {k: v[i:i + 1] for k, v in batch.items()}
        loss_fn(model, one).sum().backward()
        for n, p in model.named_parameters():
            if p.requires_grad:
                per.setdefault(n, []).append(p.grad.clone() if p.grad is not None else torch.zeros_like(p))
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(gs) for n, gs in per.items()}


def assert_close(got, want):
    assert set(got) == set(want), set(got) ^ set(want)
    for n in want:
        # a floor for gradients that vanish analytically (attention key biases): float64 noise is ~1e-17
        err = (got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-9)
        assert err <= 1e-5, f"{n}: relative error {err:.2e}"


# -- what the private methods release; runs that die; a composed config
PRIVATE = [("dp-adam", {"clipping": c}) for c in ("materialize", "bk", "ghost", "mixed", "fgc")] + [
    ("grape", {"rank": 4}), ("galore-dp-naive", {"rank": 4}),
    ("dp-sgd-rc", {"k": 8}), ("dp-sgd-rc", {"k": 8, "bookkeeping": True})]


def released(make, name, options, precision, max_grad_norm, samples=None):
    """What the method's Privatizer releases (noise off, so the clipped mean) for one step on the whole batch, or
    for each of `samples` alone."""
    torch.manual_seed(0)
    model, loss, batch = make()
    cfg = method_config(name, max_grad_norm=max_grad_norm, **options)
    method = build_method(cfg, model, 0.01, GaussianMechanism(0.0, max_grad_norm, 1.0, seeded(3)))
    outputs, call = [], Privatizer.gradient

    def spy(self, *args, **kwargs):
        grads, loss_sum = call(self, *args, **kwargs)
        outputs.append(torch.cat([g.flatten() for g in grads.values()]))
        return grads, loss_sum
    Privatizer.gradient = spy
    try:
        forward = RunPrecision(precision, torch.device("cpu")).forward(loss)
        for part in ([batch] if samples is None else [{k: v[i:i + 1] for k, v in batch.items()} for i in samples]):
            method.step([part], forward)
    finally:
        Privatizer.gradient = call
    assert all(o.dtype == torch.float32 for o in outputs)
    return outputs


def dies_at(monkeypatch, cls, step: int):
    """`cls.step` raises at its `step`-th call from now on ("the machine went away"); returns the real step, to put
    back with monkeypatch.setattr(cls, "step", real)."""
    calls, real_step = [], cls.step

    def dies(self, micro, loss_fn):
        calls.append(1)
        if len(calls) == step:
            raise RuntimeError("the machine went away")
        return real_step(self, micro, loss_fn)
    monkeypatch.setattr(cls, "step", dies)
    return real_step


def config(*overrides):
    """A composed training config: 5 steps of 32, logged every step, with `overrides`. A copy of the one composed
    for these overrides first in this process (a compose takes a fifth of a second, a copy a hundredth), to change
    at will."""
    return copy.deepcopy(_composed(overrides))


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...]):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=["train.steps=5", "train.batch_size=32", "logging.progress=false",
                                            "logging.every=1", *overrides])


# -- the largest tensor a step makes
class LargestTensor(TorchDispatchMode):
    """The most elements any op's output has while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def seeded(seed: int) -> Draws:
    """Noise draws keyed by a seed (a run's privacy.noise_seed), the same for each call: a test replays them."""
    return Draws(seed_key(seed), "noise")


def standard_noise(shapes: list, draws: Draws, dtype=torch.float32) -> list[torch.Tensor]:
    """The standard normal draws a step adds (times σC) to clipped sums of these shapes, in this order, for a model
    small enough to be one noise run (`GaussianMechanism.release`): one vector, split in order."""
    sizes = [torch.Size(shape).numel() for shape in shapes]
    assert sum(sizes) <= NOISE_BUCKET
    draw = draws.randn(sum(sizes), dtype=dtype)
    return [chunk.view(shape) for chunk, shape in zip(draw.split(sizes), shapes)]


def kept_runs(monkeypatch) -> dict:
    """Each Run that executes from now on, by its run folder's name: a test reads its model after run_training."""
    from dpmem.engine.trainer import Run

    kept, real_execute = {}, Run.execute

    def keep(self):
        kept[self.run_dir.name] = self
        return real_execute(self)
    monkeypatch.setattr(Run, "execute", keep)
    return kept


# -- the scripts, run in this process
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run_script(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python scripts/NAME ARGS...` run in this process as `__main__`, with `env` over the environment: its exit
    code and what it printed, as subprocess.run(..., capture_output=True, text=True) returns them. A fresh
    interpreter costs each script about 4.5 CPU-s of imports (torch, transformers, hydra); a test that checks the
    process itself (its threads, torch.compile's caches, its children) runs the script as one. What a script may
    change in the process comes back afterwards."""
    script, out, err = SCRIPTS / name, io.StringIO(), io.StringIO()
    argv, path, environ, cwd, modules = sys.argv[:], sys.path[:], os.environ.copy(), os.getcwd(), set(sys.modules)
    dtype, threads, grad = torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled()
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.update(env or {})
    sys.argv, sys.path[:0] = [str(script), *args], [str(SCRIPTS)]  # as `python`, whose path starts at the script's
    from warm_start import exit_status  # the status an interpreter ends with (scripts/ is on the path now)
    with torch.random.fork_rng(devices=[]), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = exit_status(lambda: runpy.run_path(str(script), run_name="__main__"))
        finally:
            sys.argv, sys.path[:] = argv, path
            os.environ.clear()
            os.environ.update(environ)
            os.chdir(cwd)
            for module in set(sys.modules) - modules:  # a script imported by another (bench_peers)
                if (SCRIPTS / f"{module}.py").is_file():
                    del sys.modules[module]
            torch.set_default_dtype(dtype)
            torch.set_num_threads(threads)
            torch.set_grad_enabled(grad)
            torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    return subprocess.CompletedProcess([sys.executable, str(script), *args], code, out.getvalue(), err.getvalue())
