"""Peak memory and throughput of every method, side by side in one process, as a markdown table.

    python scripts/bench_methods.py                                   # vit-tiny, 8x8 images, B = 8 16 32
    python scripts/bench_methods.py --image-size 32 --batch-sizes 16 32 64 \
        model.arch.hidden_size=256 model.arch.num_hidden_layers=4 model.arch.patch_size=4
    python scripts/bench_methods.py --model roberta-base --batch-sizes 16 --methods adam dp-adam grape \
        --activation-checkpointing both model.arch.num_hidden_layers=4   # what checkpointing costs

Trailing key=value arguments are Hydra overrides of the model group. Each (batch size, method) cell builds a
fresh random-init model, runs one warm-up step (optimiser state exists afterwards), then meters one step for
memory (the exact live-tensor counter on CPU; max_memory_reserved/allocated on CUDA) and times `--steps` steps.
`--activation-checkpointing both` runs every method with and without it, and gives each checkpointed cell's
memory and speed as ratios to the same method without.
Private methods run with sigma = 1, C = 1. The table lands in docs/benchmarks/methods.md (its page, headed by the
command, device, torch version and date; `--out` writes elsewhere) and is printed.
"""

from __future__ import annotations

import argparse
import time

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dpmem.composition import CONF_DIR
from dpmem.data import DataBundle, images, text
from dpmem.engine.assemble import assemble
from dpmem.metering import LiveTensorCounter
from dpmem.methods import METHODS
from dpmem.models import build_model
from dpmem.report import benchmark_page, machine, page_header, write_markdown

DEFAULT_METHODS = ["adam", "galore", "mezo", "dp-adam", "galore-dp-naive", "grape", "dpzero"]


def method_config(name: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=[f"method={name}"]).method


def make_inputs(model_cfg, batch, args, device):
    """Random inputs of the model's kind: images for vit, token ids (all attended) for text models."""
    labels = torch.randint(0, args.classes, (batch,), device=device)
    if model_cfg.family == "vit":
        shape = (1, args.image_size, args.image_size)
        x = {"pixel_values": torch.randn(batch, *shape, device=device), "labels": labels}
        return DataBundle({}, {}, args.classes, shape, images.per_sample_loss, images.predict), x
    ids = torch.randint(3, model_cfg.arch.vocab_size, (batch, args.seq_len), device=device)
    x = {"input_ids": ids, "labels": labels}
    if device.type != "meta":  # transformers inspects the mask's values (.all()), which meta tensors lack
        x["attention_mask"] = torch.ones_like(ids)
    loss, predict = text.task(model_cfg.head, list(range(3, 3 + args.classes)))
    x["mask_pos"] = torch.full((batch,), args.seq_len - 1, device=device)  # where the mlm head reads
    return DataBundle({}, {}, args.classes, (args.seq_len,), loss, predict), x


def bench_cell(model_cfg, method_name, batch, args, device, checkpointing=False):
    data, inputs = make_inputs(model_cfg, batch, args, device)
    torch.manual_seed(0)
    with torch.device(device):  # on meta nothing is allocated: memory is planned, not measured
        model = build_model(model_cfg, data).train()
    cfg = OmegaConf.create({"model": model_cfg, "method": method_config(method_name),
                            "train": {"lr": 1e-4, "seed": 0, "batch_size": batch,
                                      "activation_checkpointing": checkpointing}})
    method = assemble(cfg, device, data, model).method  # private methods: stand-in noise, sigma = 1
    micro, loss_fn = [inputs], data.per_sample_loss
    method.step(micro, loss_fn)  # warm-up: optimiser state, one-off checks
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        method.step(micro, loss_fn)
        peak = torch.cuda.max_memory_reserved()
        allocated = torch.cuda.max_memory_allocated()
    else:
        with LiveTensorCounter().track_state(model, method) as counter:
            method.step(micro, loss_fn)
        peak = allocated = counter.peak
    rate = None
    if device.type != "meta":
        tic = time.perf_counter()
        for _ in range(args.steps):
            loss = method.step(micro, loss_fn)
        float(loss)  # wait for the device
        rate = args.steps * batch / (time.perf_counter() - tic)
    return {"peak": peak, "allocated": allocated, "rate": rate, "params": n_params}


def ratio(value, base):
    return f"{value / base:.2f}" if value is not None and base else "-"


CHECKPOINTED = " + checkpointing"


def table(rows, methods, device) -> str:
    mem_name = {"cuda": "peak reserved (MiB)", "meta": "planned peak on meta (MiB)"}.get(device.type,
                                                                                     "peak live tensors (MiB)")
    lines = [f"| B | method | {mem_name} | ×dp-adam | ×adam | samples/s | ×dp-adam | ×adam | memory, speed × "
             "without checkpointing |", "|---|---|---|---|---|---|---|---|---|"]
    for batch, cells in rows:
        base = {m: cells.get(m) for m in ("dp-adam", "adam")}
        for m in methods:
            c = cells[m]
            mem = [ratio(c["peak"], base[b]["peak"]) if base[b] else "-" for b in ("dp-adam", "adam")]
            rate = [ratio(c["rate"], base[b]["rate"]) if base[b] else "-" for b in ("dp-adam", "adam")]
            speed = "-" if c["rate"] is None else f"{c['rate']:.3g}"
            plain = cells.get(m.removesuffix(CHECKPOINTED)) if m.endswith(CHECKPOINTED) else None
            own = "-" if plain is None else f"{ratio(c['peak'], plain['peak'])}, {ratio(c['rate'], plain['rate'])}"
            lines.append(f"| {batch} | {m} | {c['peak'] / 2**20:.1f} | {mem[0]} | {mem[1]} | {speed} | "
                         f"{rate[0]} | {rate[1]} | {own} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit-tiny")
    ap.add_argument("--image-size", type=int, default=8, help="for image models")
    ap.add_argument("--seq-len", type=int, default=128, help="for text models")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=sorted(METHODS))
    ap.add_argument("--steps", type=int, default=20, help="timed steps per cell")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda, cpu, or meta (memory only, no weights allocated: for models too big to run here)")
    ap.add_argument("--activation-checkpointing", choices=["off", "on", "both"], default="off")
    ap.add_argument("--out", default=benchmark_page(__file__, "methods"),
                    help="the page to write (default: docs/benchmarks/methods.md)")
    args, overrides = ap.parse_known_args()
    started = time.time()
    device = torch.device(args.device)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        model_cfg = compose("config", overrides=[f"model={args.model}", *overrides]).model
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.activation_checkpointing]
    labels = [(m + CHECKPOINTED if ck else m, m, ck) for ck in modes for m in args.methods]
    rows = []
    for batch in args.batch_sizes:
        cells = {label: bench_cell(model_cfg, m, batch, args, device, ck) for label, m, ck in labels}
        rows.append((batch, cells))
    params = rows[0][1][labels[0][0]]["params"]
    shape = (f"{args.image_size}x{args.image_size} images" if model_cfg.family == "vit"
             else f"sequence length {args.seq_len}")
    timed = "no timing on meta" if device.type == "meta" else f"{args.steps} steps timed"
    details = (f"Methods on {args.model} ({params / 1e6:.2f}M trainable parameters, {shape}, overrides: "
               f"{' '.join(overrides) or 'none'}), one step metered after one warm-up step, {timed}.")
    header = page_header("Every method side by side", machine(device), details, started)
    text = header + table(rows, [label for label, _, _ in labels], device) + "\n"
    write_markdown(args.out, text)


if __name__ == "__main__":
    main()
