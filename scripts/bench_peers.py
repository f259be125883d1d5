"""dpmem against its peers, side by side in one process: a plain PyTorch AdamW step (non-private), Opacus' per-sample
hooks and its ghost clipping, and dpmem's dp-adam in each clipping mode and grape, on the same random-init model
and batch. Steps are interleaved (one of each contestant per round) and the median of `--steps` rounds is taken
after one warm-up step each; the peak is the live-tensor counter's over one step (parameters, optimiser state and
everything the step makes). Every private contestant runs with sigma = 1, C = 1 and AdamW.

    python scripts/bench_peers.py                                       # roberta-base shape, B = 16 32, T = 128
    python scripts/bench_peers.py --model vit-tiny --batch-sizes 256    # the digits ViT of `dpmem train`
    python scripts/bench_peers.py model.arch.num_hidden_layers=4        # Hydra overrides of the model group

Text models train with their embeddings frozen and a classifier head; the ViT with its cls token and position
embeddings frozen, since Opacus has no per-sample rule for them. The table lands in outputs/bench/peers.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dpmem.cli import CONF_DIR
from dpmem.data import build_data
from dpmem.metering import LiveTensorCounter
from dpmem.engine.assemble import assemble
from dpmem.methods import method_config
from dpmem.methods.base import optimizer_state
from dpmem.models import build_model
from dpmem.report import write_markdown

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


def build(cfg, data, frozen: tuple[str, ...], state: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(cfg.model, data).train()
    if state:
        model.load_state_dict(state)
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


def backward_and_step(loss: Callable[[], torch.Tensor], opt) -> Callable[[], torch.Tensor]:
    """A step of a peer whose optimiser does the private part (Opacus) or none (AdamW)."""
    def step():
        value = loss()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value.detach()
    return step


def adamw(model, batch) -> Contestant:
    opt = torch.optim.AdamW(trainable(model), lr=LR)
    return Contestant(model, backward_and_step(lambda: per_sample_loss(model, batch).sum(), opt),
                      lambda: optimizer_state(opt))


def opacus_hooks(model, batch, size: int) -> Contestant:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    gsm = GradSampleModule(model, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.AdamW(trainable(model), lr=LR),
                      noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=size, loss_reduction="sum")
    return Contestant(model, backward_and_step(lambda: per_sample_loss(gsm, batch).sum(), opt),
                      lambda: optimizer_state(opt.original_optimizer))


def opacus_ghost(model, batch, size: int) -> Contestant:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    gsm = GradSampleModuleFastGradientClipping(model, loss_reduction="sum", max_grad_norm=1.0,
                                               use_ghost_clipping=True)
    opt = DPOptimizerFastGradientClipping(torch.optim.AdamW(trainable(model),
                                                            lr=LR),
                                          noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=size,
                                          loss_reduction="sum")
    criterion = DPLossFastGradientClipping(gsm, opt, torch.nn.CrossEntropyLoss(reduction="sum"), "sum")
    return Contestant(model, backward_and_step(lambda: criterion(logits_of(gsm, batch), batch["labels"]), opt),
                      lambda: optimizer_state(opt.original_optimizer))


def dpmem_method(cfg, data, model, batch, size: int, name: str, options: dict) -> Contestant:
    method_cfg = method_config(name, max_grad_norm=1.0,
                               **({"optimizer": "adamw"} if name in ("dp-adam", "dp-sgd-rc") else {}), **options)
    cfg = OmegaConf.merge(cfg, {"train": {"lr": LR, "batch_size": size}})
    cfg.method = method_cfg
    method = assemble(cfg, torch.device("cpu"), data, model).method  # stand-in noise: sigma = 1
    return Contestant(model, lambda: method.step([batch], per_sample_loss), method.state_tensors)


def make_batch(cfg, data, size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, data.num_classes, (size,), generator=g)
    if len(data.input_shape) == 3:
        idx = torch.randint(0, len(data.train["labels"]), (size,), generator=g)
        return {"pixel_values": data.train["pixel_values"][idx], "labels": labels}
    ids = torch.randint(3, cfg.model.arch.vocab_size, (size, *data.input_shape), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def measure(contestants: dict[str, Contestant], size: int, rounds: int) -> dict[str, dict]:
    out = {}
    for name, c in contestants.items():  # warm-up (optimiser state, one-off checks), then one metered step
        c.step()
        with LiveTensorCounter().track_state(c.model, c) as counter:
            float(c.step())
        out[name] = {"peak": counter.peak, "times": []}
    for _ in range(rounds):
        for name, c in contestants.items():
            tic = time.perf_counter()
            float(c.step())
            out[name]["times"].append(time.perf_counter() - tic)
    for v in out.values():
        v["rate"] = size / statistics.median(v["times"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="roberta-base")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="interleaved timed rounds (median)")
    ap.add_argument("--contestants", nargs="+", default=None, help="names as in the table (default: all)")
    ap.add_argument("--out", default="outputs/bench/peers.md")
    args, overrides = ap.parse_known_args()
    torch.manual_seed(0)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        text = args.model != "vit-tiny"
        data_over = ["data=synthetic", f"data.seq_len={args.seq_len}", "data.num_classes=2", "data.n_train=64",
                     "model.head=classifier"] if text else ["data=digits"]
        cfg = compose("config", overrides=[f"model={args.model}", *data_over, *overrides])
    data = build_data(cfg.data, cfg.model)
    frozen = ("embeddings.",) if text else ("embeddings.cls_token", "embeddings.position_embeddings")
    state = build(cfg, data, frozen, {}).state_dict()
    lines = ["| B | contestant | samples/s | × AdamW | peak live tensors (MiB) | × AdamW |", "|---|---|---|---|---|---|"]
    for size in args.batch_sizes:
        batch = make_batch(cfg, data, size)
        makers = {"torch AdamW (non-private)": lambda m: adamw(m, batch),
                  "Opacus hooks": lambda m: opacus_hooks(m, batch, size),
                  "Opacus ghost clipping": lambda m: opacus_ghost(m, batch, size),
                  **{label: (lambda m, n=n, o=o: dpmem_method(cfg, data, m, batch, size, n, o))
                     for label, (n, o) in DPMEM.items()}}
        chosen = args.contestants or list(makers)
        contestants = {name: makers[name](build(cfg, data, frozen, state)) for name in chosen}
        results = measure(contestants, size, args.steps)
        base = results.get("torch AdamW (non-private)")
        for name, r in results.items():
            rate = f"{r['rate'] / base['rate']:.2f}" if base else "-"
            peak = f"{r['peak'] / base['peak']:.2f}" if base else "-"
            lines.append(f"| {size} | {name} | {r['rate']:.3g} | {rate} | {r['peak'] / 2**20:.0f} | {peak} |")
        del contestants
    trainable = sum(p.numel() for p in build(cfg, data, frozen, state).parameters() if p.requires_grad)
    shape = f"T = {args.seq_len}" if text else "8×8 digits"
    header = (f"Peers on {args.model} ({trainable / 1e6:.2f}M trainable parameters, {shape}, overrides: "
              f"{' '.join(overrides) or 'none'}), {torch.get_num_threads()} CPU threads, median of {args.steps} "
              "interleaved steps after one warm-up; peak = live-tensor counter over one step.\n\n")
    write_markdown(args.out, header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
