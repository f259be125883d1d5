"""Per-sample gradient norms of one linear layer: peak memory, FLOPs and CPU time of every norm rule, as markdown tables
(DP-SGD-RC (Efficient DP-SGD for LLMs with Randomized Clipping) Figs. 2, 13, 3, 4 and Tables 6 and 8).

    python scripts/bench_norms.py                                       # the paper's setting (about 20 s on 2 cores)
    python scripts/bench_norms.py --shapes 64x32 --tokens 16 --ks 2 4 --cpu-tokens 8 --cpu-ks 2 --repeats 1

A layer `PxD` is y = x Wᵀ with W of shape (P, D): P out-features, D in-features, input A (B, T, D), output
gradient G (B, T, P), per-sample gradient Gᵢᵀ Aᵢ (P × D), i.e. the paper's p × d (Table 7: p = 8192, d = 2048).
All three default layers have p ≥ d, so Hutch/Hutch++ project the output side p (the "larger dimension"); the
projection-side table also runs each layer transposed (D × P) to exercise the other branch of `norms.hutchinson`.

Sections
  memory  on the meta device at T = --tokens (nothing is allocated): the exact live-tensor counter around one
          `squared_norms` call with A and G tracked ("with inputs") and minus their bytes ("w/o inputs",
          = Table 6's peak − initial). k larger than the projected dimension n = max(p, d) is skipped (more
          probes than dimensions: the estimate is no cheaper and no better than an exact rule).
  FLOPs   analytic counts (formulas below), plus torch's FlopCounterMode (matmuls only, 2mnk each) as a check.
  time    wall time on CPU at T = --cpu-tokens, float32, median (and min) of --repeats calls after --warmup.
Reductions are 1 − rule / baseline in %, against FGC (the baseline the paper's percentages use, see the notes
written with the tables) and against `mixed` (dpmem's best exact rule). The tables land in docs/benchmarks/norms.md
(its page, headed by the command, device, torch version and date; `--out` writes elsewhere) and are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from dpmem.metering import LiveTensorCounter
from dpmem.persample.factored import Factored
from dpmem.persample.norms import ESTIMATORS, ghost_is_cheaper, squared_norms
from dpmem.privacy.randomness import Draws, seed_key
from dpmem.report import benchmark_page, machine, page_header, write_markdown

DEFAULT_SHAPES = ["2048x2048", "8192x2048", "2048x512"]
DEFAULT_KS = [1, 4, 16, 32, 64, 128, 512, 2048, 4096]
EXACT = ("fgc", "ghost", "mixed")
MiB = 2 ** 20


def parse_shape(text: str) -> tuple[int, int]:
    p, d = text.lower().split("x")
    return int(p), int(d)


def mixed_choice(p: int, d: int, T: int) -> str:
    """The exact rule `mixed` runs for this layer (dpmem's own decision, 2T² < p·d -> ghost)."""
    probe = Factored.outer(torch.empty(1, T, p, device="meta"), torch.empty(1, T, d, device="meta"))
    return "ghost" if ghost_is_cheaper(probe) else "fgc"


def meaningful_ks(ks, p: int, d: int) -> list[int]:
    return [k for k in ks if k <= max(p, d)]


# ----------------------------------------------------------------------------------------------------- memory

def make_inputs(B, T, p, d, device, dtype=torch.float32, seed=0):
    if device.type == "meta":
        return torch.empty(B, T, d, device=device, dtype=dtype), torch.empty(B, T, p, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    A = torch.randn(B, T, d, generator=gen, device=device, dtype=dtype)
    G = torch.randn(B, T, p, generator=gen, device=device, dtype=dtype)
    return A, G


def measure_memory(p, d, T, B, rule, k=32, device="meta", dtype=torch.float32) -> dict:
    """Peak bytes of live tensor storages during one `squared_norms` call, A and G included, and their bytes."""
    device = torch.device(device)
    A, G = make_inputs(B, T, p, d, device, dtype)
    draws = None if device.type == "meta" else Draws(seed_key(1), "probes", device)
    inputs = A.untyped_storage().nbytes() + G.untyped_storage().nbytes()
    with LiveTensorCounter().track([A, G]) as counter:
        out = squared_norms(Factored.outer(G, A), rule, k=k, draws=draws)
    assert out.shape == (B,)
    return {"peak": counter.peak, "inputs": inputs, "extra": counter.peak - inputs}


def table6_extra(rule, p, d, T, B, k, itemsize=4):
    """Paper Table 6 (backprops not deleted), peak − initial in bytes: FGC Bpd, GC 2BT², RC (p ≥ d)
    Bk(T + d) + pk, written with n = max(p, d), m = min(p, d) for either side. None where the paper has none."""
    n, m = max(p, d), min(p, d)
    if rule == "mixed":
        rule = mixed_choice(p, d, T)
    elems = {"fgc": B * p * d, "ghost": 2 * B * T * T, "hutch": B * k * (T + m) + n * k}.get(rule)
    return None if elems is None else elems * itemsize


# ------------------------------------------------------------------------------------------------------ FLOPs

def qr_flops(rows: int, cols: int) -> int:
    """Householder QR of one rows × cols matrix, reduced Q formed explicitly (LAPACK geqrf + orgqr counts)."""
    r, long = min(rows, cols), max(rows, cols)
    geqrf = 2 * long * r * r - 2 * r ** 3 / 3
    orgqr = 4 * rows * r * r - 2 * (rows + r) * r * r + 4 * r ** 3 / 3
    return round(geqrf + orgqr)


def flops(rule, p, d, T, B, k=32) -> int:
    """Floating-point operations (multiplies + adds) of one `squared_norms` call; random number generation and
    dtype casts are not counted. n = max(p, d) is the projected side, m = min(p, d) the side probes land in.

      fgc      B·p·d·(2T − 1)                      paper Table 8 exactly: the Gᵢᵀ Aᵢ products only (dpmem also
                                                   squares and sums them, + 2Bpd − B, 1/T of the total)
      ghost    2BT²(p + d) − B                     paper Table 8; equals dpmem's count (two Grams, ⊙, Σ)
      mixed    whichever of the two dpmem picks (2T² < p·d -> ghost)
      hutch    nk                                  probes / √k
             + BTk(2n − 1) + Bmk(2T − 1)           gᵢᵀP = Aᵢᵀ(GᵢP)   (p ≥ d; mirrored for p < d)
             + 2Bmk − B                            ‖·‖² per sample
               = 2BTk(p + d) + Bk(m − T) − B + nk, the paper's Table 8 RC row (its exact column) plus nk
      hutchpp  2nk (P, S) + 2 × [BTk(2n − 1) + Bmk(2T − 1)]   gᵢᵀP, gᵢᵀS
             + BTr(2n − 1) + Bmr(2T − 1)           gᵢᵀQ, r = min(n, k) columns of Q
             + BTk(2m − 1) + Bnk(2T − 1)           gᵢ(gᵢᵀS) (the "back" pass)
             + B·QR(n × k)                         Q of the (B, n, k) sketch
             + Brk(2n − 1) + Bmk(2r − 1) + Bmk     QᵀP, head·(QᵀP), subtraction
             + (2Bmr − B) + (2Bmk − B) + B         ‖head‖² + ‖residual‖²
    """
    n, m = max(p, d), min(p, d)
    if rule == "mixed":
        rule = mixed_choice(p, d, T)
    if rule == "fgc":
        return B * p * d * (2 * T - 1)
    if rule == "ghost":
        return 2 * B * T * T * (p + d) - B
    def into_small(cols):  # gᵢᵀx for x of shape (n, cols): (Gᵢx) then Aᵢᵀ(·) for p ≥ d
        return B * T * cols * (2 * n - 1) + B * m * cols * (2 * T - 1)

    if rule == "hutch":
        return n * k + into_small(k) + 2 * B * m * k - B
    if rule == "hutchpp":
        r = min(n, k)
        back = B * T * k * (2 * m - 1) + B * n * k * (2 * T - 1)
        small = B * r * k * (2 * n - 1) + B * m * k * (2 * r - 1) + B * m * k
        norms = (2 * B * m * r - B) + (2 * B * m * k - B) + B
        return 2 * n * k + 2 * into_small(k) + into_small(r) + back + B * qr_flops(n, k) + small + norms
    raise ValueError(rule)


def torch_matmul_flops(p, d, T, B, rule, k=32) -> int:
    """torch's own count (FlopCounterMode: mm/bmm at 2mnk, nothing else) of one call on the meta device."""
    A, G = make_inputs(B, T, p, d, torch.device("meta"))
    with FlopCounterMode(display=False) as counter:
        squared_norms(Factored.outer(G, A), rule, k=k)
    return counter.get_total_flops()


# ------------------------------------------------------------------------------------------------------- time

def time_cells(p, d, T, B, cells, repeats, warmup) -> dict:
    """Seconds per call of each (rule, k) cell on CPU. The cells are timed round-robin (one call of each per
    round) so that load from other processes spreads evenly over them."""
    A, G = make_inputs(B, T, p, d, torch.device("cpu"))
    draws = Draws(seed_key(1), "probes")
    g = Factored.outer(G, A)
    times = {c: [] for c in cells}
    for i in range(warmup + repeats):
        for rule, k in cells:
            tic = time.perf_counter()
            squared_norms(g, rule, k=k or 32, draws=draws)
            if i >= warmup:
                times[(rule, k)].append(time.perf_counter() - tic)
    return times


# ------------------------------------------------------------------------------------------------- validation

def validate_meta_vs_cpu(p=48, d=24, T=12, B=2, k=4) -> list[dict]:
    """The counter only sees storages and op outputs, so a call must peak at the same bytes on meta and CPU."""
    rows = []
    for pp, dd in ((p, d), (d, p)):
        for rule in ("fgc", "ghost", "mixed", "hutch", "hutchpp"):
            meta = measure_memory(pp, dd, T, B, rule, k, "meta")["peak"]
            cpu = measure_memory(pp, dd, T, B, rule, k, "cpu")["peak"]
            rows.append({"shape": f"{pp}x{dd}", "rule": rule, "k": k if rule in ESTIMATORS else None,
                         "meta": meta, "cpu": cpu})
    return rows


# ----------------------------------------------------------------------------------------------------- tables

def pct(value, base):
    return f"{100 * (1 - value / base):.2f}" if base else "-"


def rule_name(rule, p, d, T):
    return f"mixed (→{mixed_choice(p, d, T)})" if rule == "mixed" else rule


def memory_section(shapes, ks, T, B) -> tuple[str, dict]:
    lines = [f"### Peak memory (meta device, T = {T}, B = {B}, float32)", "",
             "| layer p×d | n | rule | k | peak with inputs (MiB) | extra = peak − A,G (MiB) | Table 6 extra (MiB) "
             "| red. vs FGC % | red. vs FGC w/o inputs % | red. vs mixed % | red. vs mixed w/o inputs % "
             "| red. vs FGC, + weight % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    results, skipped = {}, []
    for p, d in shapes:
        cells = [(rule, None) for rule in EXACT]
        kept = meaningful_ks(ks, p, d)
        skipped += [f"{p}x{d}: k = {k}" for k in ks if k not in kept]
        cells += [(rule, k) for k in kept for rule in ESTIMATORS]
        res = {(rule, k): measure_memory(p, d, T, B, rule, k if k else 32) for rule, k in cells}
        results[(p, d)] = res
        fgc, mixed = res[("fgc", None)], res[("mixed", None)]
        weight = p * d * 4
        for (rule, k), r in res.items():
            t6 = table6_extra(rule, p, d, T, B, k or 0)
            lines.append(
                f"| {p}x{d} | {max(p, d)} | {rule_name(rule, p, d, T)} | {k or '-'} | {r['peak'] / MiB:.6g} "
                f"| {r['extra'] / MiB:.6g} | {'-' if t6 is None else f'{t6 / MiB:.6g}'} "
                f"| {pct(r['peak'], fgc['peak'])} | {pct(r['extra'], fgc['extra'])} "
                f"| {pct(r['peak'], mixed['peak'])} | {pct(r['extra'], mixed['extra'])} "
                f"| {pct(r['peak'] + weight, fgc['peak'] + weight)} |")
    if skipped:
        lines += ["", f"Skipped (k > n = max(p, d), more probes than the projected dimension): {', '.join(skipped)}."]
    return "\n".join(lines), results


def symmetry_section(shapes, T, B, k) -> str:
    lines = [f"### Projection side (meta, T = {T}, B = {B}, k = {k}): the layer and its transpose", "",
             "| layer p×d | projected side | rule | extra (MiB) | transposed d×p | projected side | extra (MiB) "
             "| equal |", "|---|---|---|---|---|---|---|---|"]
    for p, d in shapes:
        if k > max(p, d):
            continue
        for rule in ESTIMATORS:
            a = measure_memory(p, d, T, B, rule, k)["extra"]
            b = measure_memory(d, p, T, B, rule, k)["extra"]
            side = "p (out)" if p >= d else "d (in)"
            side_t = "p (out)" if d >= p else "d (in)"
            lines.append(f"| {p}x{d} | {side} | {rule} | {a / MiB:.6g} | {d}x{p} | {side_t} | {b / MiB:.6g} "
                         f"| {'yes' if a == b else 'NO'} |")
    return "\n".join(lines)


def flops_section(shapes, ks, T, B) -> str:
    lines = [f"### FLOPs (analytic, T = {T}, B = {B})", "",
             "| layer p×d | rule | k | GFLOP (formula) | GFLOP (torch matmul count) | red. vs FGC % "
             "| red. vs mixed % | red. vs GC % |", "|---|---|---|---|---|---|---|---|"]
    for p, d in shapes:
        cells = [(rule, None) for rule in EXACT]
        cells += [(rule, k) for k in meaningful_ks(ks, p, d) for rule in ESTIMATORS]
        fgc, ghost, mixed = (flops(r, p, d, T, B) for r in EXACT)
        for rule, k in cells:
            f = flops(rule, p, d, T, B, k or 32)
            tf = torch_matmul_flops(p, d, T, B, rule, k or 32)
            lines.append(f"| {p}x{d} | {rule_name(rule, p, d, T)} | {k or '-'} | {f / 1e9:.4g} | {tf / 1e9:.4g} "
                         f"| {pct(f, fgc)} | {pct(f, mixed)} | {pct(f, ghost)} |")
    return "\n".join(lines)


def time_section(shapes, ks, T, B, repeats, warmup) -> tuple[str, dict]:
    lines = [f"### CPU wall time (T = {T}, B = {B}, float32, {torch.get_num_threads()} threads, median and min of "
             f"{repeats} round-robin calls after {warmup} warm-up)", "",
             "| layer p×d | rule | k | median (ms) | min (ms) | speed-up vs FGC | red. vs FGC % | speed-up vs mixed "
             "| hutchpp ÷ hutch |", "|---|---|---|---|---|---|---|---|---|"]
    data = {}
    for p, d in shapes:
        cells = [(rule, None) for rule in EXACT]
        cells += [(rule, k) for k in meaningful_ks(ks, p, d) for rule in ESTIMATORS]
        times = time_cells(p, d, T, B, cells, repeats, warmup)
        med = {c: statistics.median(t) for c, t in times.items()}
        data[(p, d)] = med
        fgc, mixed = med[("fgc", None)], med[("mixed", None)]
        for (rule, k), t in med.items():
            ratio = f"{t / med[('hutch', k)]:.2f}" if rule == "hutchpp" else "-"
            lines.append(f"| {p}x{d} | {rule_name(rule, p, d, T)} | {k or '-'} | {1e3 * t:.3f} "
                         f"| {1e3 * min(times[(rule, k)]):.3f} | {fgc / t:.2f} | {pct(t, fgc)} | {mixed / t:.2f} "
                         f"| {ratio} |")
    return "\n".join(lines), data


PAPER_SETTING = {"large": (8192, 2048), "small": (2048, 512), "T": 4096, "B": 2, "k": 32}


def paper_section(shapes, ks, T, B, memory, times, cpu_T) -> str:
    """DP-SGD-RC's quoted numbers next to this run's, where this run covers the paper's setting."""
    large, small, k = PAPER_SETTING["large"], PAPER_SETTING["small"], PAPER_SETTING["k"]
    if (T, B) != (PAPER_SETTING["T"], PAPER_SETTING["B"]) or k not in ks or not {large, small} <= set(shapes):
        return "### Against the paper\n\nNot the paper's setting (T = 4096, B = 2, k = 32, 8192x2048 and 2048x512)."
    lines = ["### Against the paper (DP-SGD-RC Figs. 2, 13, 3, 4; baseline FGC = mixed here)", "",
             "| quantity | paper | dpmem, this run |", "|---|---|---|"]
    mem = memory[large]
    base = mem[("fgc", None)]
    red = {r: (pct(mem[(r, k)]["peak"], base["peak"]), pct(mem[(r, k)]["extra"], base["extra"]),
               pct(mem[(r, k)]["peak"] + 4 * large[0] * large[1], base["peak"] + 4 * large[0] * large[1]))
           for r in ESTIMATORS}
    lines.append(f"| peak-memory reduction, {large[0]}x{large[1]}, k = {k}, Hutch / Hutch++, with inputs "
                 f"| 39.18 / 38.57 | {red['hutch'][0]} / {red['hutchpp'][0]} (A, G tracked); "
                 f"{red['hutch'][2]} / {red['hutchpp'][2]} (+ p×d weight) |")
    lines.append(f"| same, without inputs (Fig. 13) | 99.22 / 97.65 | {red['hutch'][1]} / {red['hutchpp'][1]} |")
    for rule, paper in (("hutch", "98.05 / 92.19"), ("hutchpp", "92.17 / 68.69")):
        vals = [pct(flops(rule, p, d, T, B, k), flops("fgc", p, d, T, B)) for p, d in (large, small)]
        lines.append(f"| FLOP reduction vs FGC, k = {k}, {rule}, {large[0]}x{large[1]} / {small[0]}x{small[1]} "
                     f"| {paper} | {vals[0]} / {vals[1]} |")
    vanish = []
    for p, d in (large, small):
        res = memory[(p, d)]
        gone = [kk for kk in meaningful_ks(ks, p, d) if res[("hutch", kk)]["peak"] >= res[("fgc", None)]["peak"]]
        vanish.append(str(gone[0]) if gone else f"> {max(meaningful_ks(ks, p, d))}")
    lines.append(f"| first swept k where Hutch's memory gain is gone, {large[0]}x{large[1]} / {small[0]}x{small[1]} "
                 f"| 4096 / 512 | {vanish[0]} / {vanish[1]} |")
    if times and large in times and ("hutch", k) in times[large]:
        ratio = times[large][("hutchpp", k)] / times[large][("hutch", k)]
        lines.append(f"| Hutch++ ÷ Hutch time, {large[0]}x{large[1]}, k = {k} | ≈ 3 (A100, T = 4096) "
                     f"| {ratio:.2f} (CPU, T = {cpu_T}) |")
    return "\n".join(lines)


def validation_section(rows) -> str:
    lines = ["### Meta peak vs CPU peak (same call, real tensors on CPU)", "",
             "| layer p×d | rule | k | meta peak (B) | CPU peak (B) | equal |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['rule']} | {r['k'] or '-'} | {r['meta']} | {r['cpu']} "
                     f"| {'yes' if r['meta'] == r['cpu'] else 'NO'} |")
    return "\n".join(lines)


NOTES = """### Notes

- Baseline of the paper's percentages: exact DP-SGD with the per-sample gradient materialised (FGC), as
  measured on its GPU: a peak − initial of about 2·B·p·d (the gradient and a same-size temporary, such as its
  elementwise square), not Table 6's B·p·d and not GC. dpmem's `fgc` holds B·p·d (a fused norm, no squared
  copy), so its RC reductions are smaller than the paper's: RC gains less against a leaner baseline. For these
  layers at T = 4096 p·d ≤ T², so FGC is also the better exact rule (`mixed` picks it). Checks:
  FLOPs: 98.05 / 92.19 % are exactly 1 − RC/FGC of Table 8 (vs GC every layer would give 99.22 %).
  Memory without inputs, 8192x2048, k = 32: 99.22 % = 1 − 2 MiB / 256 MiB with Hutch's BTk + pk = 2 MiB
  (Table 6 with backprops deleted) and a 256 MiB baseline = 2·B·p·d·4 B; against Table 6's (and dpmem's) FGC,
  128 MiB, it is 98.4 %. Gains vanishing at k = 4096 on 8192x2048 and at k = 512 on 2048x512 fit 2·B·p·d on
  both layers; against B·p·d the 8192x2048 gain is gone at k = 2048, as measured here. With inputs:
  39.18 / 38.57 % need a baseline peak of about 648 MiB = A + G (320) + 256 + ≈ 72 MiB: consistent with the fp32
  weight (64 MiB) plus ≈ 8 MiB (cuBLAS workspace?) being resident in the paper's GPU measurement.
- "w/o inputs" is the peak minus the bytes of A and G, i.e. Table 6's peak − initial.
- "+ weight" adds the layer's p×d float32 weight to both peaks (resident in a real step; the counter here only
  tracks A and G).
- FLOP formulas are in `flops()` (docstring); RNG is not counted. The paper's Hutch++ numbers (92.17 / 68.69 %)
  are this count without the B·QR(n × k) term (with it: 92.15 / 68.59 %). The torch column is FlopCounterMode, which
  counts only matmuls (2mnk each) and no QR.
- CPU times: one process on a possibly shared machine; the min column shows how noisy the median is.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="layers PxD: P out-, D in-features")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096, help="T for memory (meta) and FLOPs")
    ap.add_argument("--ks", type=int, nargs="+", default=DEFAULT_KS, help="probe counts for memory and FLOPs")
    ap.add_argument("--symmetry-k", type=int, default=32, help="k of the projection-side table")
    ap.add_argument("--cpu-tokens", type=int, default=256, help="T for the CPU timing")
    ap.add_argument("--cpu-ks", type=int, nargs="+", default=[4, 32, 128, 512], help="probe counts timed")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per cell (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per cell first")
    ap.add_argument("--threads", type=int, default=1 if (os.cpu_count() or 1) <= 2 else os.cpu_count(),
                    help="torch threads for the timing; 1 on machines with ≤ 2 cores: on a shared 2-core box "
                         "2 threads stall on each other (a (2, 8192, 32) QR took 340 ms with 2, 2.6 ms with 1)")
    ap.add_argument("--skip-time", action="store_true", help="no CPU timing")
    ap.add_argument("--out", default=benchmark_page(__file__, "norms"),
                    help="the page to write (default: docs/benchmarks/norms.md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tic = time.time()
    shapes = [parse_shape(s) for s in args.shapes]
    B = args.batch
    memory, mem_data = memory_section(shapes, args.ks, args.tokens, B)
    parts = [memory, "", symmetry_section(shapes, args.tokens, B, args.symmetry_k), "",
             flops_section(shapes, args.ks, args.tokens, B), ""]
    time_data = {}
    if not args.skip_time:
        timing, time_data = time_section(shapes, args.cpu_ks, args.cpu_tokens, B, args.repeats, args.warmup)
        parts += [timing, ""]
    parts += [paper_section(shapes, args.ks, args.tokens, B, mem_data, time_data, args.cpu_tokens), "",
              validation_section(validate_meta_vs_cpu()), "", NOTES]
    details = (f"Layers {', '.join(args.shapes)} (p×d = out×in), B = {B}: memory on the meta device and FLOPs at "
               f"T = {args.tokens}, " + ("no CPU timing." if args.skip_time else f"CPU time at T = {args.cpu_tokens}."))
    header = page_header("Per-sample norm rules on single linear layers", machine(threads=args.threads), details, tic)
    write_markdown(args.out, header + "\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
