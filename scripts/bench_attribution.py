"""What the attribution proof costs (`dpmem.methods.attribution`): one private step's CPU time with the proof (the
first micro-batch of a run: one more backward pass of Σᵢ wᵢ ℓᵢ, nothing streamed) against the same step without it,
side by side in one process, as a ratio; per model and clipping plan.

    python scripts/bench_attribution.py                            # BERT, GPT-2, ViT; B = 16, T = 64 (about a minute)
    python scripts/bench_attribution.py --batch 4 --seq 8 --repeats 1 --models gpt2 --plans bk --out /tmp/a.md

Each timing is the median of --repeats steps after a warm-up, each on a fresh Privatizer (the proof runs once per
Privatizer), noise on; the step is `Privatizer.gradient` on one micro-batch, its release included. The page lands in
docs/benchmarks/attribution.md (`--out` elsewhere) and is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.privatize import Privatizer
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, seed_key
from dpmem.report import benchmark_page, machine, page_header, write_markdown


def text_model(name: str, width: int, layers: int, seq: int):
    import transformers
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=1000, hidden_size=width, num_hidden_layers=layers,
                                      num_attention_heads=4, intermediate_size=4 * width, max_position_embeddings=seq,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2)
        model = transformers.BertForSequenceClassification(cfg)

        def loss(m, b):
            return F.cross_entropy(m(input_ids=b["input_ids"]).logits, b["labels"], reduction="none")
    else:
        cfg = transformers.GPT2Config(vocab_size=1000, n_positions=seq, n_embd=width, n_layer=layers, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)

        def loss(m, b):
            logits = m(input_ids=b["input_ids"]).logits[:, :-1]
            return F.cross_entropy(logits.transpose(1, 2), b["input_ids"][:, 1:], reduction="none").sum(1)
    return model, loss, lambda B: {"input_ids": torch.randint(0, 1000, (B, seq)), "labels": torch.randint(0, 2, (B,))}


def vit_model(width: int, layers: int, seq: int):
    import transformers
    side = max(2, int(seq ** 0.5)) * 2  # about `seq` patches of 2×2
    cfg = transformers.ViTConfig(image_size=side, patch_size=2, num_channels=3, hidden_size=width,
                                 num_hidden_layers=layers, num_attention_heads=4, intermediate_size=4 * width,
                                 num_labels=10)
    model = transformers.ViTForImageClassification(cfg)

    def loss(m, b):
        return F.cross_entropy(m(pixel_values=b["pixel_values"]).logits, b["labels"], reduction="none")
    return model, loss, lambda B: {"pixel_values": torch.randn(B, 3, side, side), "labels": torch.randint(0, 10, (B,))}


def step_seconds(model, loss, batch, plan: str, check: bool) -> float:
    """One private step's seconds on a fresh Privatizer (its first micro-batch proves attribution where `check`)."""
    mechanism = GaussianMechanism(1.0, 1.0, float(len(next(iter(batch.values())))), Draws(seed_key(0), "noise"))
    with Privatizer(model, mechanism, ClippingPlan.of(plan), check) as privatizer:
        shapes = {p: p.shape for p in privatizer.params}
        start = time.perf_counter()
        privatizer.gradient([batch], loss, shapes)
        return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["bert", "gpt2", "vit"], choices=["bert", "gpt2", "vit"])
    ap.add_argument("--plans", nargs="+", default=["materialize", "bk", "ghost"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64, help="tokens per sample (ViT: about as many patches)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = args.out or benchmark_page(__file__, "attribution")
    started = time.time()
    torch.manual_seed(0)
    rows = []
    for name in args.models:
        model, loss, make = vit_model(args.width, args.layers, args.seq) if name == "vit" else \
            text_model(name, args.width, args.layers, args.seq)
        batch = make(args.batch)
        for plan in args.plans:
            step_seconds(model, loss, batch, plan, True)  # warm-up (both paths)
            step_seconds(model, loss, batch, plan, False)
            timed = {check: statistics.median(step_seconds(model, loss, batch, plan, check)
                                              for _ in range(args.repeats)) for check in (False, True)}
            rows.append(f"| {name} | {plan} | {timed[False] * 1e3:.1f} | {timed[True] * 1e3:.1f} | "
                        f"{timed[True] / timed[False]:.2f} |")
    text = page_header("The attribution proof's cost", machine("cpu"),
                       f"B = {args.batch}, T = {args.seq}, width {args.width}, {args.layers} layers, float32, median "
                       f"of {args.repeats}.", started)
    text += ("| model | plan | step without the proof (ms) | first step, with it (ms) | ratio |\n"
             "|---|---|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
             "The proof runs on a run's first micro-batch and on one whose layers are read anew; every other step is "
             "the left column's.\n")
    write_markdown(out, text)


if __name__ == "__main__":
    main()
