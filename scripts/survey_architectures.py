"""Hugging Face architectures no dpmem config names, each as a tiny random-init model of its own config class: does
dpmem's private step form every per-sample gradient right, or refuse in one line? For each model type and clipping
plan, the clipped sum (σ 0) against a loop of one-sample backward passes in float64 (C the median per-sample norm),
the model in eval mode so that both sides run the same forward (dropout off); for grape, its projected release of
the batch against the sum of its samples' releases, each alone (additive over samples; one has nothing to mix with);
and bk's step compiled whole (train.compile, fullgraph) against the loop, or why it is not one graph.
A refusal whose fix is to freeze what it names is followed: that is frozen and the model tried again, so the page says
whether the fix it gives trains exactly. "not built" is a tiny config this script could not make (not dpmem's).

    python scripts/survey_architectures.py                          # every type below, every plan (a few minutes)
    python scripts/survey_architectures.py --types bert,mpnet --plans bk --compiled bert --out /tmp/a.md

The page lands in docs/benchmarks/architectures.md (`--out` elsewhere) and is printed.
"""

from __future__ import annotations

import argparse
import re
import time

import torch
import torch.nn.functional as F
import transformers as tf

from dpmem.compiling import Compiler
from dpmem.config import ConfigError
from dpmem.data.bundle import Padded
from dpmem.methods import build_method, method_config
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.privatize import Privatizer
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, seed_key
from dpmem.report import benchmark_page, machine, page_header, write_markdown

B, T, VOCAB = 4, 6, 40
SMALL = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=VOCAB,
             max_position_embeddings=32, num_labels=3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             num_key_value_heads=1, head_dim=8, n_positions=32, rotary_dim=4)
VISION = dict(num_labels=3, image_size=16, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=32, patch_size=4)
# (head, config overrides over SMALL or VISION): the types whose tiny config needs more than the common keys
TYPES = {
    # DeBERTa-v3's layout: relative attention over a shared position table, projected by the tokens' layers
    "deberta-v2": ("classifier", {"relative_attention": True, "position_buckets": 8, "max_relative_positions": 16,
                                  "pos_att_type": ["p2c", "c2p"], "share_att_key": True, "norm_rel_ebd": "layer_norm"}),
    **{t: ("classifier", {}) for t in ("bert", "roberta", "xlm-roberta", "mpnet", "deberta", "electra",
                                       "albert", "distilbert", "big_bird", "megatron-bert", "ernie", "rembert",
                                       "roformer", "layoutlm", "mobilebert", "data2vec-text")},
    "longformer": ("classifier", {"attention_window": 8}),
    **{t: ("causal", {}) for t in ("gpt2", "gptj", "gpt_bigcode", "bloom", "codegen", "opt", "llama", "mistral",
                                   "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "stablelm",
                                   "starcoder2", "olmo", "olmo2", "gpt_neox", "cohere", "granite", "xglm", "ctrl",
                                   "biogpt")},
    "falcon": ("causal", {"head_dim": None}),  # a property of its config, not a key
    **{t: ("image", {}) for t in ("vit", "beit", "dinov2", "data2vec-vision", "focalnet")},
    "swin": ("image", {"embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 2,
                       "num_attention_heads": None}),  # its alias of num_heads, which is a list
    "poolformer": ("image", {"hidden_sizes": [8, 16, 16, 16], "depths": [1, 1, 1, 1]}),
    "segformer": ("image", {"hidden_sizes": [8, 16, 16, 16], "depths": [1, 1, 1, 1], "num_attention_heads": [1] * 4,
                            "sr_ratios": [2, 1, 1, 1], "decoder_hidden_size": 16}),
    "resnet": ("image", {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1]}),
}
PLANS = ("materialize", "bk", "ghost", "mixed", "fgc", "grape")  # grape: its projected release, another oracle
# the refusals whose fix is to freeze what they name: a shared output the model sizes itself (its layers), rows
# that are not samples (the layer), a weight read where no tap sees it (the parameter)
BROADCAST = re.compile(r"^([\w.]+)(?: \(and \d+ more before it failed: ([\w., ]+)\))?: its output is shared")
ROWS = re.compile(r"^(?:.*: )?([\w.]+)(?::|'s output has \d+·B rows).*freeze (?:its|their) parameters")
OUTSIDE = re.compile(r": ([\w.]+) is used outside the module that owns it.*or freeze it\b")


def to_freeze(model, line: str) -> list:
    """The modules or parameters a refusal says to freeze ([] where its fix is another)."""
    if (found := BROADCAST.match(line)) is not None:
        names = [found.group(1)] + (found.group(2).split(", ") if found.group(2) else [])
        return [model.get_submodule(n) for n in names]
    if (found := OUTSIDE.search(line)) is not None:
        return [model.get_parameter(found.group(1))]
    if (found := ROWS.match(line)) is not None:
        return [model.get_submodule(found.group(1))]
    return []


def build(model_type: str):
    head, extra = TYPES[model_type]
    keys = {**(VISION if head == "image" else SMALL), **extra}
    keys = {k: v for k, v in keys.items() if v is not None}
    config = tf.AutoConfig.for_model(model_type, **keys)
    auto = {"classifier": tf.AutoModelForSequenceClassification, "causal": tf.AutoModelForCausalLM,
            "image": tf.AutoModelForImageClassification}[head]
    # eval: no dropout, drop path or layer drop, module or functional, so that the loop oracle's forward passes are
    # the step's (a private run trains; the rules do not depend on the mode)
    return auto.from_config(config).double().eval(), head


def batch_and_loss(head: str):
    g = torch.Generator().manual_seed(0)
    if head == "image":
        batch = {"pixel_values": torch.randn(B, 3, 16, 16, generator=g, dtype=torch.float64),
                 "labels": torch.randint(0, 3, (B,), generator=g)}
        return batch, lambda m, b: F.cross_entropy(m(pixel_values=b["pixel_values"]).logits, b["labels"],
                                                   reduction="none")
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # one padded sample
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (B,), generator=g)}
    if head == "classifier":
        return batch, lambda m, b: F.cross_entropy(m(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                                                   .logits, b["labels"], reduction="none")

    def causal(m, b):
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
        target = b["input_ids"][:, 1:].masked_fill(b["attention_mask"][:, 1:] == 0, -100)
        return F.cross_entropy(logits.transpose(1, 2), target, reduction="none", ignore_index=-100).sum(1)
    return batch, causal


def loop_clipped_sum(model, loss_fn, batch) -> tuple[torch.Tensor, float]:
    """The oracle: each sample's gradient by a backward pass of its own, clipped at the median norm and summed."""
    params = [p for p in model.parameters() if p.requires_grad]
    per = []
    for i in range(B):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(loss_fn(model, one).sum(), params, allow_unused=True)
        per.append(torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads)]))
    per = torch.stack(per)
    norms = per.norm(dim=1)
    C = float(norms.median())
    return ((C / (norms + 1e-6)).clamp(max=1.0) @ per), C


def grape_release(model, loss_fn, batch, C: float, samples: list[int]) -> torch.Tensor:
    """DP-GRAPE's first release (σ 0, rank 4, every layer's projection from the run's seed) of `samples` alone."""
    method = build_method(method_config("grape", rank=4, max_grad_norm=C), model, 0.0,
                          GaussianMechanism(0.0, C, 1.0, Draws(seed_key(0), "noise")))
    try:
        part = {k: v[samples] for k, v in batch.items()}
        got, _ = method.privatizer.gradient([part], loss_fn, method.shapes, method._projections(1))
    finally:
        method.close()
    return torch.cat([g.flatten() for g in got.values()])


def grape_gap(model, loss_fn, batch, C: float) -> float:
    """The batch's release against the sum of its samples' releases, each alone (a batch of one has no sample to
    mix with): the projected clipped sum is additive over samples."""
    want = sum(grape_release(model, loss_fn, batch, C, [i]) for i in range(B))
    return float((grape_release(model, loss_fn, batch, C, list(range(B))) - want).norm() / want.norm())


def private_clipped_sum(model, loss_fn, batch, plan: str, C: float) -> torch.Tensor:
    with Privatizer(model, GaussianMechanism(0.0, C, 1.0, None), ClippingPlan.of(plan)) as privatizer:
        got = privatizer.gradient([batch], loss_fn, {p: p.shape for p in privatizer.params}).gradient
    return torch.cat([got[p].flatten() for p in model.parameters() if p.requires_grad])


def compiled_gap(model, loss_fn, batch, C: float, want: torch.Tensor) -> tuple[float | None, str]:
    """bk's clipped sum with the micro-batch compiled whole (train.compile's step, fullgraph, dynamo's eager
    backend: whether it is one graph does not depend on the backend), its second step, against the loop: (gap,
    what the capture was), or (None, why it is not one graph)."""
    compiler = Compiler(torch.device("cpu"), "eager")
    try:
        with Privatizer(model, GaussianMechanism(0.0, C, 1.0, None), ClippingPlan.of("bk")) as privatizer:
            privatizer.compile(compiler)
            for _ in range(2):  # the first is the eager rehearsal (the proof) and the compile; the second reuses it
                got = privatizer.gradient([Padded(batch, B)], loss_fn, {p: p.shape for p in privatizer.params})
    except Exception as e:  # noqa: BLE001  (a graph break under fullgraph, or a compile failure: reported)
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    got = torch.cat([got.gradient[p].flatten() for p in model.parameters() if p.requires_grad])
    capture = compiler.capture()
    shape = ("one graph" if capture["graphs"] == 1 and not capture["graph_breaks"] else
             f"{capture['graphs']} graphs, {capture['graph_breaks']} breaks")
    return float((got - want).norm() / want.norm()), shape


def survey(model_type: str, plans, compiled: bool) -> tuple[str, str]:
    """(verdict, detail) for one model type; `compiled`: bk's compiled step too."""
    try:
        torch.manual_seed(0)
        model, head = build(model_type)
    except Exception as e:  # noqa: BLE001  (a tiny config the script could not make)
        return "not built", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    batch, loss_fn = batch_and_loss(head)
    try:
        loss_fn(model, batch)
    except Exception as e:  # noqa: BLE001  (its own forward fails at this size: not dpmem's)
        return "not built", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    frozen, unprojected = [], ""
    while True:
        try:
            want, C = loop_clipped_sum(model, loss_fn, batch)
            gaps = {plan: float((private_clipped_sum(model, loss_fn, batch, plan, C) - want).norm() / want.norm())
                    for plan in plans if plan != "grape"}
            if "grape" in plans:
                try:
                    gaps["grape"] = grape_gap(model, loss_fn, batch, C)
                except ConfigError as e:  # a convnet: no Linear for grape to project
                    unprojected = f"; grape: {e}"
        except (ValueError, RuntimeError) as e:
            line = str(e).splitlines()[0]
            fix = to_freeze(model, line)
            if not fix or len(frozen) > 20:
                return "refused", line + (f" (after freezing {', '.join(frozen)})" if frozen else "")
            names = {id(t): n for n, t in [*model.named_modules(), *model.named_parameters()]}
            for part in fix:
                part.requires_grad_(False)
                frozen.append(names[id(part)])
            continue
        compiled_note = ""
        if compiled:
            gaps["compiled"], shape = compiled_gap(model, loss_fn, batch, C, want)
            compiled_note = f"; compiled: {shape}" if gaps["compiled"] is not None else f"; not compiled: {shape}"
        worst = max(g for g in gaps.values() if g is not None)
        verdict = "exact" if worst <= 1e-6 else "WRONG"  # float32 islands (RMSNorm, rotary) reach 1e-7
        return verdict, (f"largest relative gap {worst:.1e}" + (f", with {', '.join(frozen)} frozen" if frozen else "")
                         + unprojected + compiled_note)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated model types (default: all below)")
    ap.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of {', '.join(PLANS)} (default: all)")
    ap.add_argument("--compiled", default=None, help="comma-separated model types whose bk step is also compiled "
                    "(default: every type surveyed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    types, plans = args.types.split(","), args.plans.split(",")
    compiled = set(types if args.compiled is None else args.compiled.split(","))
    unknown = [t for t in types if t not in TYPES] + [p for p in plans if p not in PLANS]
    if unknown:
        ap.error(f"unknown: {', '.join(unknown)}; types: {', '.join(TYPES)}; plans: {', '.join(PLANS)}")
    out = args.out or benchmark_page(__file__, "architectures")
    started = time.time()
    torch.set_default_dtype(torch.float64)
    rows = []
    for model_type in types:
        verdict, detail = survey(model_type, plans, model_type in compiled)
        rows.append(f"| {model_type} | {TYPES[model_type][0]} | {verdict} | {detail.replace('|', '/')} |")
        print(rows[-1], flush=True)
    text = page_header("Architectures without a dpmem config", machine("cpu"),
                       f"Tiny random-init models (1 layer, width 16), B = {B}, float64, plans {', '.join(plans)}, "
                       f"transformers {tf.__version__}.", started)
    wrong = sum("| WRONG |" in row for row in rows)
    text += ("| model type | head | verdict | detail |\n|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
             "exact: every plan's clipped sum within 1e-6 of the loop's (1e-16 where nothing computes in float32), and "
             "grape's release of the batch (σ 0, rank 4) within that of the sum of its samples' releases, each alone, "
             "and bk's compiled step (fullgraph; its second call) within that of the loop's. "
             "refused: the run's own one-line refusal, before anything is released. WRONG: a clipped sum that the "
             f"proof let through, off by more than that: {wrong} here.\n")
    write_markdown(out, text)


if __name__ == "__main__":
    main()
