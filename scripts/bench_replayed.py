"""The replayed layers' cost (nn.MultiheadAttention under vmap, nn.LSTM one sample at a time, a TransformerEncoder):
one private step (DP-Adam's bk plan, after its first step, whose attribution proof is `bench_attribution.py`'s)
against the same model's non-private forward and backward, side by side in one process, as ratios of CPU time and of
peak live-tensor bytes (`LiveTensorCounter`, exact on the CPU).

    python scripts/bench_replayed.py                      # B = 16, T = 32, width 64 (a few seconds)
    python scripts/bench_replayed.py --batch 2 --seq 4 --width 8 --repeats 1 --out /tmp/r.md

For reference a Linear-only stack of the same width (every layer under a factored rule) is measured the same way.
The page lands in docs/benchmarks/replayed.md (`--out` elsewhere) and is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from dpmem.metering import LiveTensorCounter
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.privatize import Privatizer
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, seed_key
from dpmem.report import benchmark_page, machine, page_header, write_markdown


class Sequence(nn.Module):
    def __init__(self, kind: str, width: int):
        super().__init__()
        self.emb, self.head, self.kind = nn.Embedding(100, width), nn.Linear(width, 2), kind
        if kind == "MultiheadAttention":
            self.layer = nn.MultiheadAttention(width, 4, batch_first=True)
        elif kind == "LSTM":
            self.layer = nn.LSTM(width, width, batch_first=True)
        elif kind == "TransformerEncoder":
            self.layer = nn.TransformerEncoder(nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0,
                                                                          batch_first=True), 1,
                                               enable_nested_tensor=False)
        else:  # Linear layers only: factored rules
            self.layer = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, ids):
        x = self.emb(ids)
        out = self.layer(x, x, x)[0] if self.kind == "MultiheadAttention" else self.layer(x)
        return self.head((out[0] if isinstance(out, tuple) else out).mean(1))


def loss(m, b):
    return F.cross_entropy(m(b["ids"]), b["y"], reduction="none")


def measured(step) -> tuple[float, int]:
    """(seconds, peak live bytes beyond what existed before) of one call."""
    with LiveTensorCounter() as counter:
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
    return seconds, counter.peak


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = args.out or benchmark_page(__file__, "replayed")
    started = time.time()
    torch.manual_seed(0)
    batch = {"ids": torch.randint(0, 100, (args.batch, args.seq)), "y": torch.randint(0, 2, (args.batch,))}
    rows = []
    for kind in ("Linear (factored rules)", "MultiheadAttention", "LSTM", "TransformerEncoder"):
        model = Sequence(kind.split()[0], args.width)

        def plain():
            model.zero_grad(set_to_none=True)
            loss(model, batch).sum().backward()
            model.zero_grad(set_to_none=True)

        mechanism = GaussianMechanism(1.0, 1.0, float(args.batch), Draws(seed_key(0), "noise"))
        with Privatizer(model, mechanism, ClippingPlan.of("bk")) as privatizer:
            shapes = {p: p.shape for p in privatizer.params}
            privatizer.gradient([batch], loss, shapes)  # its first step: the attribution proof

            def private():
                privatizer.gradient([batch], loss, shapes)
            plain(), private()  # warm-up
            runs = {name: [measured(f) for _ in range(args.repeats)] for name, f in (("plain", plain),
                                                                                     ("private", private))}
        t = {name: statistics.median(s for s, _ in r) for name, r in runs.items()}
        m = {name: max(b for _, b in r) for name, r in runs.items()}
        rows.append(f"| {kind} | {t['plain'] * 1e3:.1f} | {t['private'] * 1e3:.1f} | {t['private'] / t['plain']:.2f} "
                    f"| {m['plain'] / 2**10:.1f} | {m['private'] / 2**10:.1f} | {m['private'] / m['plain']:.2f} |")
    text = page_header("Replayed layers against non-private training", machine("cpu"),
                       f"B = {args.batch}, T = {args.seq}, width {args.width}, one layer, float32, DP-Adam's bk plan, "
                       f"median of {args.repeats} steps.", started)
    text += ("| layer | non-private step (ms) | private step (ms) | time ratio | non-private peak (KiB) | "
             "private peak (KiB) | memory ratio |\n|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
             "The replays' per-sample gradients are dense (B × the layer's parameters), and the LSTM's replay is a "
             "loop of B autograd calls; the Linear row is what factored rules cost on the same stack.\n")
    write_markdown(out, text)


if __name__ == "__main__":
    main()
