"""Peak memory and throughput of every method, side by side in one process, as a markdown table.

    python scripts/bench_methods.py                                   # vit-tiny, 8x8 images, B = 8 16 32
    python scripts/bench_methods.py --image-size 32 --batch-sizes 16 32 64 \
        model.arch.hidden_size=256 model.arch.num_hidden_layers=4 model.arch.patch_size=4

Trailing key=value arguments are Hydra overrides of the model group. Each (batch size, method) cell builds a
fresh random-init model, runs one warm-up step (optimiser state exists afterwards), then meters one step for
memory (the exact live-tensor counter on CPU; max_memory_reserved/allocated on CUDA) and times `--steps` steps.
Private methods run with sigma = 1, C = 1. The table lands in outputs/bench/ (and is printed).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from dpmem.cli import CONF_DIR
from dpmem.data import DataBundle
from dpmem.data.images import per_sample_loss, predict
from dpmem.engine.metering import LiveTensorCounter, state_tensors
from dpmem.methods import METHODS, Noise, build_method
from dpmem.models import build_model

DEFAULT_METHODS = ["adam", "galore", "mezo", "dp-adam", "galore-dp-naive", "grape", "dpzero"]


def method_config(name: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=[f"method={name}"]).method


def bench_cell(model_cfg, method_name, batch, image_size, classes, steps, device):
    shape = (1, image_size, image_size)
    data = DataBundle({}, {}, classes, shape, per_sample_loss, predict)
    torch.manual_seed(0)
    model = build_model(model_cfg, data).to(device).train()
    cfg = method_config(method_name)
    gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(0)
    noise = Noise(1.0, 1.0, float(batch), gen) if METHODS[method_name].private else None
    method = build_method(cfg, model, 1e-4, noise)
    x = torch.randn(batch, *shape, device=device)
    micro = [{"pixel_values": x, "labels": torch.randint(0, classes, (batch,), device=device)}]
    method.step(micro, per_sample_loss)  # warm-up: optimiser state, one-off checks
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        method.step(micro, per_sample_loss)
        peak = torch.cuda.max_memory_reserved()
        allocated = torch.cuda.max_memory_allocated()
    else:
        with LiveTensorCounter().track(state_tensors(model, method)) as counter:
            method.step(micro, per_sample_loss)
        peak = allocated = counter.peak
    tic = time.perf_counter()
    for _ in range(steps):
        loss = method.step(micro, per_sample_loss)
    float(loss)  # wait for the device
    rate = steps * batch / (time.perf_counter() - tic)
    return {"peak": peak, "allocated": allocated, "rate": rate, "params": n_params}


def ratio(value, base):
    return f"{value / base:.2f}" if base else "-"


def table(rows, methods, device) -> str:
    mem_name = "peak reserved (MiB)" if device.type == "cuda" else "peak live tensors (MiB)"
    lines = [f"| B | method | {mem_name} | ×dp-adam | ×adam | samples/s | ×dp-adam | ×adam |",
             "|---|---|---|---|---|---|---|---|"]
    for batch, cells in rows:
        base = {m: cells.get(m) for m in ("dp-adam", "adam")}
        for m in methods:
            c = cells[m]
            mem = [ratio(c["peak"], base[b]["peak"]) if base[b] else "-" for b in ("dp-adam", "adam")]
            rate = [ratio(c["rate"], base[b]["rate"]) if base[b] else "-" for b in ("dp-adam", "adam")]
            lines.append(f"| {batch} | {m} | {c['peak'] / 2**20:.1f} | {mem[0]} | {mem[1]} | {c['rate']:.0f} | "
                         f"{rate[0]} | {rate[1]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit-tiny")
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=sorted(METHODS))
    ap.add_argument("--steps", type=int, default=20, help="timed steps per cell")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="outputs/bench/methods.md")
    args, overrides = ap.parse_known_args()
    device = torch.device(args.device)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        model_cfg = compose("config", overrides=[f"model={args.model}", *overrides]).model
    rows = []
    for batch in args.batch_sizes:
        cells = {m: bench_cell(model_cfg, m, batch, args.image_size, args.classes, args.steps, device)
                 for m in args.methods}
        rows.append((batch, cells))
    params = rows[0][1][args.methods[0]]["params"]
    header = (f"Methods on {args.model} ({params / 1e6:.2f}M trainable parameters, {args.image_size}x"
              f"{args.image_size} inputs, overrides: {' '.join(overrides) or 'none'}), device {device}, "
              f"one step metered after one warm-up step, {args.steps} steps timed.\n\n")
    text = header + table(rows, args.methods, device) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
