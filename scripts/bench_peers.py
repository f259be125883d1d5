"""dpmem against its peers, side by side in one process: a plain PyTorch AdamW step (non-private), Opacus' per-sample
hooks and its ghost clipping, and dpmem's dp-adam in each clipping mode and grape, on the same random-init model
and batch. Steps are interleaved (one of each contestant per round) and the median of `--steps` rounds is taken
after one warm-up step each; the peak is the live-tensor counter's over one step (parameters, optimiser state and
everything the step makes). Every private contestant runs with sigma = 1, C = 1 and AdamW.

    python scripts/bench_peers.py                                       # roberta-base shape, B = 16 32, T = 128
    python scripts/bench_peers.py --model vit-tiny --batch-sizes 256    # the digits ViT of `dpmem train`
    python scripts/bench_peers.py model.arch.num_hidden_layers=4        # Hydra overrides of the model group

Text models train with their embeddings frozen and a classifier head; the ViT with its cls token and position
embeddings frozen, since Opacus has no per-sample rule for them. The table lands in docs/benchmarks/peers.md (its
page, headed by the command, device, torch version and date; `--out` writes elsewhere).

`--count-ops` adds the number of aten ops one training step dispatches (a TorchDispatchMode counts every op that
reaches `__torch_dispatch__`, the backward's and the optimiser's included: forward, backward, clipping, noise,
optimiser step, zeroing of gradients), counted over one step after the warm-up and outside the timed rounds. It is
a proxy for the host's work per step (Python and dispatch overhead) that does not depend on the machine's speed.
Every contestant's AdamW is torch's for-each implementation (`foreach=True`: its default on CUDA, and what dpmem
uses on every device), so that a count taken on the CPU is the one CUDA's step dispatches.

`--device cuda` puts models and batches on the GPU and runs the contestants one at a time: each is built, warmed
up, counted, metered (peak = torch.cuda.max_memory_allocated over one step, from a reset after the warm-up, so
parameters, gradients and optimiser state are in it), timed over `--steps` consecutive steps with
torch.cuda.synchronize() around each, and freed before the next is built. `--precision tf32` (CUDA only) lets
float32 matmuls and convolutions run in TF32 for the run; `--precision bf16` runs every contestant's forward under
torch.autocast(bfloat16) (dpmem's through dpmem.precision.RunPrecision.forward, as `dpmem train` does), its
backward and optimiser step outside. The CUDA path has not been run on a GPU yet.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from dpmem.composition import CONF_DIR
from dpmem.data import build_data
from dpmem.engine.assemble import assemble
from dpmem.metering import LiveTensorCounter
from dpmem.methods import method_config
from dpmem.methods.base import optimizer_state
from dpmem.models import build_model
from dpmem.precision import RunPrecision, unsupported
from dpmem.report import benchmark_page, machine, page_header, write_markdown

ADAMW = "torch AdamW (non-private)"
LR = 1e-4
DPMEM = {"dpmem dp-adam (materialize)": ("dp-adam", {"clipping": "materialize"}),
         "dpmem dp-adam (bk)": ("dp-adam", {"clipping": "bk"}),
         "dpmem dp-adam (ghost)": ("dp-adam", {"clipping": "ghost"}),
         "dpmem dp-adam (mixed)": ("dp-adam", {"clipping": "mixed"}),
         "dpmem dp-sgd-rc (hutch, two passes)": ("dp-sgd-rc", {}),
         "dpmem dp-sgd-rc (hutch, bk)": ("dp-sgd-rc", {"bookkeeping": True}),
         "dpmem grape": ("grape", {})}


class Contestant:
    """A model and a step on it; `state()` is what it keeps between steps besides the model (optimiser state)."""

    def __init__(self, model, step: Callable[[], torch.Tensor], state: Callable[[], list[torch.Tensor]]):
        self.model, self.step, self.state = model, step, state

    def state_tensors(self) -> list[torch.Tensor]:
        return self.state()


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active, on every thread the autograd engine runs the backward on
    (dispatch modes travel with its thread-local state)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def build(cfg, data, frozen: tuple[str, ...], state: dict, device=torch.device("cpu")) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(cfg.model, data).train()
    if state:
        model.load_state_dict(state)
    model.to(device)
    for n, p in model.named_parameters():
        if any(f in n for f in frozen):
            p.requires_grad_(False)
    return model


def logits_of(model, batch):
    if "pixel_values" in batch:
        return model(pixel_values=batch["pixel_values"]).logits
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def per_sample_loss(model, batch):
    return F.cross_entropy(logits_of(model, batch), batch["labels"], reduction="none")


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def backward_and_step(loss: Callable[[], torch.Tensor], opt, autocast) -> Callable[[], torch.Tensor]:
    """A step of a peer whose optimiser does the private part (Opacus) or none (AdamW); its forward (the loss) runs
    under `autocast()`, the backward and the optimiser step outside it."""
    def step():
        with autocast():
            value = loss()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value.detach()
    return step


def adamw(model, batch, prec: RunPrecision) -> Contestant:
    opt = torch.optim.AdamW(trainable(model), lr=LR, foreach=True)
    return Contestant(model, backward_and_step(lambda: per_sample_loss(model, batch).sum(), opt, prec.autocast),
                      lambda: optimizer_state(opt))


def opacus_hooks(model, batch, size: int, prec: RunPrecision) -> Contestant:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    gsm = GradSampleModule(model, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.AdamW(trainable(model), lr=LR, foreach=True),
                      noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=size, loss_reduction="sum")
    return Contestant(model, backward_and_step(lambda: per_sample_loss(gsm, batch).sum(), opt, prec.autocast),
                      lambda: optimizer_state(opt.original_optimizer))


def opacus_ghost(model, batch, size: int, prec: RunPrecision) -> Contestant:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    gsm = GradSampleModuleFastGradientClipping(model, loss_reduction="sum", max_grad_norm=1.0,
                                               use_ghost_clipping=True)
    opt = DPOptimizerFastGradientClipping(torch.optim.AdamW(trainable(model), lr=LR, foreach=True),
                                          noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=size,
                                          loss_reduction="sum")
    criterion = DPLossFastGradientClipping(gsm, opt, torch.nn.CrossEntropyLoss(reduction="sum"), "sum")
    return Contestant(model, backward_and_step(lambda: criterion(logits_of(gsm, batch), batch["labels"]), opt,
                                               prec.autocast),
                      lambda: optimizer_state(opt.original_optimizer))


def dpmem_method(cfg, data, model, batch, size: int, name: str, options: dict, prec: RunPrecision,
                 train: dict | None = None) -> Contestant:
    """dpmem's `name` with method `options` (and `train` keys: activation checkpointing) on one batch."""
    method_cfg = method_config(name, max_grad_norm=1.0,
                               **({"optimizer": "adamw"} if name in ("dp-adam", "dp-sgd-rc") else {}), **options)
    cfg = OmegaConf.merge(cfg, {"train": {"lr": LR, "batch_size": size, **(train or {})}})
    cfg.method = method_cfg
    method = assemble(cfg, prec.device, data, model).method  # stand-in noise: sigma = 1
    loss_fn = prec.forward(per_sample_loss)  # the forward under autocast (bf16), as `dpmem train` runs it
    contestant = Contestant(model, lambda: method.step([batch], loss_fn), method.state_tensors)
    contestant.method = method  # scripts/bench_compile.py compiles it
    return contestant


def make_batch(cfg, data, size: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, data.num_classes, (size,), generator=g)
    if len(data.input_shape) == 3:
        idx = torch.randint(0, len(data.train["labels"]), (size,), generator=g)
        batch = {"pixel_values": data.train["pixel_values"][idx], "labels": labels}
    else:
        ids = torch.randint(3, cfg.model.arch.vocab_size, (size, *data.input_shape), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return {k: v.to(device) for k, v in batch.items()}


def timed(step: Callable[[], torch.Tensor], cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    tic = time.perf_counter()
    float(step())  # waits for the device
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - tic


def measure(makers: dict[str, Callable[[], Contestant]], size: int, rounds: int, device: torch.device,
            count_ops: bool, warmup: int = 1, metered: Callable[[str], bool] = lambda name: True) -> dict[str, dict]:
    """Each contestant is built and takes `warmup` timed warm-up steps (optimiser state, one-off checks, compiling),
    then one untimed step and one step with its ops counted (`count_ops`), then one metered step (on CPU, for the
    names `metered` accepts: the live-tensor counter is a dispatch mode, which a compiled step refuses). On CPU all stay resident and `rounds`
    interleaved rounds of one step each are timed; on CUDA each is timed over `rounds` consecutive steps and freed
    before the next is built, so that max_memory_allocated sees one contestant only."""
    cuda = device.type == "cuda"
    out, resident = {}, {}
    for name, make in makers.items():
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        c = make()
        r = out[name] = {"times": [], "warm": [timed(c.step, cuda) for _ in range(warmup)]}
        if count_ops:  # one step, outside the timed ones: the mode's Python call per op slows every op
            float(c.step())  # the steady state: dpmem's second step still makes what it keeps (streamed zeros)
            with OpCounter() as ops:
                loss = c.step()
            float(loss)
            r["ops"] = ops.count
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)  # the peak starts at what is allocated now
            float(c.step())
            torch.cuda.synchronize()
            r["peak"] = torch.cuda.max_memory_allocated(device)
            r["times"] = [timed(c.step, True) for _ in range(rounds)]
            del c
        else:
            if metered(name):
                with LiveTensorCounter().track_state(c.model, c) as counter:
                    float(c.step())
                r["peak"] = counter.peak
            resident[name] = c
    for _ in range(rounds):
        for name, c in resident.items():
            out[name]["times"].append(timed(c.step, False))
    for v in out.values():
        v["rate"] = size / statistics.median(v["times"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="roberta-base")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="timed rounds (median)")
    ap.add_argument("--contestants", nargs="+", default=None, help="names as in the table (default: all)")
    ap.add_argument("--count-ops", action="store_true", help="count the aten ops of one step of each contestant")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default="fp32")
    ap.add_argument("--out", default=benchmark_page(__file__, "peers"),
                    help="the page to write (default: docs/benchmarks/peers.md)")
    args, overrides = ap.parse_known_args()
    started = time.time()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available here")
    device = torch.device(args.device)
    if why := unsupported(args.precision, device):
        ap.error(f"--precision {args.precision}: {why}")
    torch.manual_seed(0)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        text = args.model != "vit-tiny"
        data_over = ["data=synthetic", f"data.seq_len={args.seq_len}", "data.num_classes=2", "data.n_train=64",
                     "model.head=classifier"] if text else ["data=digits"]
        cfg = compose("config", overrides=[f"model={args.model}", *data_over, *overrides])
    data = build_data(cfg.data, cfg.model)
    frozen = ("embeddings.",) if text else ("embeddings.cls_token", "embeddings.position_embeddings")
    model = build(cfg, data, frozen, {})
    state, n_trainable = model.state_dict(), sum(p.numel() for p in trainable(model))
    del model
    peak_name = "peak allocated (MiB)" if device.type == "cuda" else "peak live tensors (MiB)"
    lines = [f"| B | contestant | samples/s | × AdamW | {peak_name} | × AdamW |"
             + (" aten ops / step | × AdamW |" if args.count_ops else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if args.count_ops else "")]
    with RunPrecision(args.precision, device) as prec:  # the TF32 switches for the run
        for size in args.batch_sizes:
            batch = make_batch(cfg, data, size, device)
            peers = {ADAMW: lambda m: adamw(m, batch, prec),
                     "Opacus hooks": lambda m: opacus_hooks(m, batch, size, prec),
                     "Opacus ghost clipping": lambda m: opacus_ghost(m, batch, size, prec),
                     **{label: (lambda m, n=n, o=o: dpmem_method(cfg, data, m, batch, size, n, o, prec))
                        for label, (n, o) in DPMEM.items()}}
            makers = {name: (lambda make=peers[name]: make(build(cfg, data, frozen, state, device)))
                      for name in args.contestants or list(peers)}
            results = measure(makers, size, args.steps, device, args.count_ops)
            base = results.get(ADAMW)
            for name, r in results.items():
                rate = f"{r['rate'] / base['rate']:.2f}" if base else "-"
                peak = f"{r['peak'] / base['peak']:.2f}" if base else "-"
                row = f"| {size} | {name} | {r['rate']:.3g} | {rate} | {r['peak'] / 2**20:.0f} | {peak} |"
                if args.count_ops:
                    row += f" {r['ops']} | {r['ops'] / base['ops']:.2f} |" if base else f" {r['ops']} | - |"
                lines.append(row)
    shape = f"T = {args.seq_len}" if text else "8×8 digits"
    timing = (f"contestants one at a time, median of {args.steps} steps" if device.type == "cuda"
              else f"median of {args.steps} interleaved steps")
    metered = ("peak = torch.cuda.max_memory_allocated over one step" if device.type == "cuda"
               else "peak = live-tensor counter over one step")
    ops = ("aten ops counted over one step after the warm-up (outside the timed steps)" if args.count_ops
           else "aten ops not counted")
    details = (f"Peers on {args.model} ({n_trainable / 1e6:.2f}M trainable parameters, {shape}, overrides: "
               f"{' '.join(overrides) or 'none'}), {timing} after one warm-up; precision {args.precision}; "
               f"{metered}; {ops}.")
    header = page_header("dpmem beside its peers", machine(device), details, started)
    write_markdown(args.out, header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
