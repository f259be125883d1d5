"""`dpmem plan` (docs/plan.md): every candidate configuration (plan.candidates × plan.checkpointing) at the run's
logical batch, with the largest physical batch whose planned peak fits memory.budget (`largest_physical`), timed by
a roofline of the ops its steps dispatch (dpmem.engine.roofline) for each of plan.precisions, ranked (RANKING).
Under privacy.noise=bandmf, each row also gives the most bands that fit beside it (`fitting_bands`, BANDS_RULE)."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from typing import Callable

from omegaconf import OmegaConf

from dpmem.config import ConfigError, enum_value
from dpmem.engine.planner import plan, reserved_estimate
from dpmem.engine.roofline import Device, OpCounter, step_seconds
from dpmem.engine.trainer import accounting_of
from dpmem.methods import method_class
from dpmem.privacy import UnreachableTarget

STATE = ("parameters", "gradients", "optimizer_state", "noise_buffers")  # what activation checkpointing cannot shrink
PROBE = 8  # the second physical batch size planned, to measure the peak's growth per sample
FULL_PLANS = 3  # full plans per candidate, at most, to find its largest fitting size
CLOSE_ENOUGH = 1.05  # a fitting size within 5% of the next guess is kept (a plan of OPT-6.7B costs ~8 s)
FAMILIES = ("first-order", "zeroth-order")  # in the order they are ranked
RANKING = ("Ranked by estimated samples/s within each family of methods: {asked}first-order methods (a backward "
           "pass), then zeroth-order ones (dpzero, mezo: forward passes only). A zeroth-order step's samples are "
           "cheap, but it needs many more steps to the same result (experiment=dpgrape/fig6-convergence runs DPZero "
           "for 10 times DP-GRAPE's steps), so samples/s does not compare across the two.")
BANDS_RULE = ("bandmf's bands (privacy.bands=b): a step keeps its last b − 1 noise vectors, each the size of what it "
              "releases (the clipped sums: every trainable parameter for dp-adam and galore-dp-naive; grape's r×n "
              "projections and its unprojected parameters; dpzero's one scalar), live through every step and "
              "evaluation, so peak(b) = peak(b₀) + (b − b₀) × one band's bytes at any physical batch (b, b₀ ≥ 2; "
              "b₀ the planned bands). The most bands that fit: the largest b whose reserved estimate is within the "
              "budget, up to min(steps, a projected method's refresh), where bands are cut, and floor(n / logical "
              "batch): bandmf's cyclic groups, one per band, must each hold a batch. A row's speed is estimated at "
              "b₀ (each band adds one pass over a band's bytes to a step).")


def family(method: str) -> str:
    return FAMILIES[method_class(method).spec.zeroth_order]


def base_mistake(rows: list[dict], refused: list[dict]) -> None:
    """Nothing planned, and every candidate refused under one key that none of them sets: the mistake is the base
    configuration's, raised as its own one-line error rather than as a budget that nothing fits."""
    keys = {r["error"].key for r in refused if "error" in r}
    if rows or len(keys) != 1 or len(refused) != sum("error" in r for r in refused):
        return
    (key,) = keys
    if not any(key == own or key.startswith(own + ".") for r in refused for own in r["own"]):
        raise refused[0]["error"]


def rank(rows: list[dict], asked: str | None = None) -> list[dict]:
    """Fitting rows first: the method asked for, then by family (FAMILIES), each by estimated samples/s; then the
    rows that do not fit, by peak."""
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: (
        r["method"] != asked if asked else False, FAMILIES.index(family(r["method"])), -r["samples_per_s"]))
    return fitting + sorted((r for r in rows if not r["fits"]), key=lambda r: r["peak_bytes"])


def _fits(row: dict, budget: int) -> bool:
    return row["reserved_estimate_bytes"] <= budget


def largest_physical(cfg, budget: int, counted: Callable[[int], dict]) -> tuple[int, dict, dict]:
    """The largest physical batch ≤ train.batch_size whose plan fits `budget`, its plan by `counted` (ops
    counted), and the quick plan at 1; (0, the plan at 1, the quick plan) if not one sample fits. Quick plans (one
    metered step of one micro-batch) at 1 (nothing fits: done) and PROBE give the peak's growth per sample (a peak
    is affine in the physical batch); the largest size that then fits is planned in full (two micro-batches,
    whatever the logical batch); from there the line through the last two peaks gives the next size (halving
    between the sizes known to fit and not to, where the line leaves them), for at most FULL_PLANS full plans."""
    batch = cfg.train.batch_size
    quick = OmegaConf.merge(cfg, {"memory": {"steps": 2}})
    first = plan(quick, batch, 1, first_micro_batches=1)
    if not _fits(first, budget):
        return 0, first, first
    limit = budget / (1 + cfg.memory.allocator_overhead)  # the tensor bytes that fit

    def guess(a: tuple[int, int], b: tuple[int, int]) -> int:
        """Where the line through two (size, peak) points meets the budget."""
        growth = (b[1] - a[1]) / (b[0] - a[0])
        return batch if growth <= 0 else min(batch, b[0] + math.floor((limit - b[1]) / growth))
    points = [(1, first["peak_bytes"])]
    if batch > 1:
        probe = min(batch, PROBE)
        points.append((probe, plan(quick, batch, probe, first_micro_batches=1)["peak_bytes"]))
    size = max(1, guess(*points[-2:])) if batch > 1 else 1
    fits, fails, best = 0, batch + 1, None  # full plans: the largest size that fits, the smallest that does not
    for _ in range(FULL_PLANS):
        row = counted(size)
        if _fits(row, budget):
            fits, best = size, row
        else:
            fails = size
        points.append((size, row["peak_bytes"]))
        other = [p for p in points[:-1] if p[0] != size]  # the line through this plan and the last other one
        following = guess(other[-1], points[-1]) if other else fails - 1
        if not fits < following < fails:  # the line leaves what is not known yet: halve it
            following = (fits + fails) // 2
        if not fits < following < fails or best is not None and following <= fits * CLOSE_ENOUGH:
            break
        size = following
    if best is None and fails > 1:  # no try fitted: the smallest size decides
        row = counted(1)
        fits, best = (1, row) if _fits(row, budget) else (0, None)
    return (fits, best, first) if best is not None else (0, row, first)


def candidate(cfg, budget: int, device: Device, precisions: tuple[str, ...]) -> dict:
    """One configuration's largest fitting physical batch, its peak, its estimated step at each precision, and under
    bandmf the most bands that fit beside it (`fitting_bands`) and beside its quick plan at physical batch 1."""
    counter = functools.partial(OpCounter, device, precisions)

    def counted(size: int) -> dict:
        return plan(cfg, cfg.train.batch_size, size, first_micro_batches=2, roofline=counter, account=True)
    physical, row, first = largest_physical(cfg, budget, counted)
    overhead = cfg.memory.allocator_overhead
    bands = fitting_bands(row["noise"], row["peak_bytes"], budget, overhead)
    if bands:  # at physical batch 1, from its quick plan: a lower bound of the peak there
        bands["largest_at_1"] = fitting_bands(first["noise"], first["peak_bytes"], budget, overhead)["largest"]
    found = {"physical_batch_size": physical, "peak_bytes": row["peak_bytes"],
             "reserved_estimate_bytes": row["reserved_estimate_bytes"], "fits": physical > 0,
             "state_bytes": sum(row["breakdown"][c] for c in STATE), "breakdown": row["breakdown"],
             "peak_part": row["peak_part"], "micro_batches": row["micro_batches"], "bands": bands}
    if physical:
        privacy = row["privacy"] or {}
        found["sigma"], found["epsilon"] = privacy.get("sigma"), privacy.get("epsilon_target")
        found["accountant"] = privacy.get("accountant")
        one, two = row["roofline"]
        found["estimates"] = {p: step_seconds(one, two, row["micro_batches"], device, p, cfg.train.batch_size)
                              for p in precisions}
        found["top_ops"] = sorted(two["by_op"].items(), key=lambda kv: -kv[1][0])[:8]
    return found


def fitting_bands(noise: dict | None, peak: int, budget: int, overhead: float) -> dict | None:
    """Under bandmf, the most bands whose peak fits `budget` beside a plan of `peak` bytes at `noise['bands']` bands
    (BANDS_RULE), and the peak at each power of two up to the most that change anything; None for other noise, or a
    band that keeps nothing (b = 1: no buffer to extrapolate from)."""
    if not noise or not noise.get("band_bytes") or noise["bands"] < 2:
        return None
    planned, band, most = noise["bands"], noise["band_bytes"], noise["most_bands"]

    def peak_at(b: int) -> int:
        return peak + (b - planned) * band

    def fits(b: int) -> bool:
        return reserved_estimate(peak_at(b), overhead) <= budget
    guess = planned + math.floor((budget / (1 + overhead) - peak) / band)  # the line, then its rounding checked
    largest = max(1, min(most, guess))
    while largest >= 2 and not fits(largest):
        largest -= 1
    while largest < most and fits(largest + 1):
        largest += 1
    largest = largest if largest >= 2 else None
    shown = sorted({*(2**k for k in range(1, most.bit_length()) if 2**k <= most), planned, most,
                    *([largest] if largest else [])})
    return {"planned": planned, "band_bytes": band, "most": most, "largest": largest,
            "peaks": [{"bands": b, "peak_bytes": peak_at(b), "reserved_estimate_bytes":
                       reserved_estimate(peak_at(b), overhead), "fits": fits(b)} for b in shown]}


def bands_text(bands: dict, physical: int) -> str:
    """A row's bands in one line: what a band costs, and the most that fit at its physical batch and at 1."""
    def most(largest: int | None, at: int) -> str:
        return f"privacy.bands ≤ {largest} at physical batch {at}" if largest else f"none at physical batch {at}"
    fit = most(bands["largest"], physical or 1) + (f", {most(bands['largest_at_1'], 1)}" if physical > 1 else "")
    return (f"bandmf keeps b − 1 noise buffers of {size_text(bands['band_bytes'])} each (planned b = "
            f"{bands['planned']}); fit: {fit} (b ≥ 2; usable: at most {bands['most']}, as the horizon and the groups "
            "allow)")


def choose(compose: Callable[[list[str]], object], overrides: list[str], budget: int, device: Device,
           log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> dict:
    """Plan every candidate of `overrides` (the user's, composed by `compose`). Returns the plan: the device, the
    budget, one row per (candidate, checkpointing), each at its fastest precision, ranked (`rank`), and the
    candidates that were refused (a configuration error) or skipped."""
    base = compose(overrides)
    pc = base.plan
    for key, value, allowed in (("plan.checkpointing", pc.checkpointing, "[false], [true] or [false,true]"),
                                ("plan.precisions", pc.precisions, "[fp32], [tf32] or [fp32,tf32]")):
        if not value:
            raise ConfigError(key, f"is empty: nothing would be planned; give {allowed}")
    if pc.top < 1:
        raise ConfigError("plan.top", f"is {pc.top}: the plan prints the commands of the best plan.top "
                          "configurations; give 1 or more")
    precisions = ("fp32",) if device.name == "cpu" else tuple(dict.fromkeys(enum_value(p) for p in pc.precisions))
    if "bf16" in precisions:
        raise ConfigError("plan.precisions", "bf16 is not planned: autocast has no meta backend (allowed: fp32, tf32)")
    if not pc.candidates:
        raise ConfigError("plan.candidates", "is empty: name at least one configuration, e.g. ['method=grape']")
    seen = {}  # a candidate's overrides, in any order: planned twice it would be two identical rows
    for option in pc.candidates:
        first = seen.setdefault(tuple(sorted(option.split())), option)
        if first is not option:
            raise ConfigError("plan.candidates", f"{option!r} is listed twice (first as {first!r}): each candidate "
                              "is planned once; remove the repeat")
    rows, refused, interrupted = [], [], False
    try:
        for option in pc.candidates:
            state = None  # the first variant's state between steps (STATE), which checkpointing keeps
            for checkpointing in sorted(dict.fromkeys(pc.checkpointing)):
                chosen = [*option.split(), f"train.activation_checkpointing={str(checkpointing).lower()}"]
                label = " ".join(chosen)
                if state is not None and reserved_estimate(state, base.memory.allocator_overhead) > budget:
                    refused.append({"configuration": label, "why": f"its parameters, gradients, optimizer "
                                    f"state and noise buffers alone ({state / 2**30:.2f} GiB) exceed the budget, "
                                    "with or without checkpointing"})
                    log(f"dpmem plan: {label}: not planned ({refused[-1]['why']})")
                    continue
                try:
                    cfg = compose([*overrides, *chosen])
                    forward_only = family(cfg.method.name) == "zeroth-order"
                    if forward_only:  # no backward pass: one row, named without the checkpointing it ignores
                        chosen, label = option.split(), option
                    found = candidate(cfg, budget, device, precisions)
                except ConfigError as e:
                    # the keys its overrides set (`method=grape method.rank=8` sets method and method.rank)
                    own = {word.split("=", 1)[0].lstrip("+~") for word in chosen}
                    refused.append({"configuration": label, "why": str(e), "error": e, "own": own})
                    log(f"dpmem plan: {label}: refused ({e})")
                    continue
                state = found["state_bytes"] if not found["fits"] else None
                log(f"dpmem plan: {label}: " + (f"physical batch {found['physical_batch_size']}, peak "
                    f"{found['peak_bytes'] / 2**30:.2f} GiB" if found["fits"] else
                    f"does not fit (peak ≥ {found['peak_bytes'] / 2**30:.2f} GiB at physical batch 1)"))
                if found["bands"]:
                    log(f"dpmem plan: {label}: " + bands_text(found["bands"], found["physical_batch_size"]))
                row = {"configuration": label, "overrides": chosen, "method": cfg.method.name,
                       "checkpointing": checkpointing, **found}
                if found["fits"]:  # at its fastest precision (the memory is the same)
                    row["precision"] = max(precisions, key=lambda p: found["estimates"][p]["samples_per_s"])
                    row.update(found["estimates"][row["precision"]])
                    row["overrides"] = chosen + [f"train.precision={row['precision']}"]
                rows.append(row)
                if forward_only:
                    break
    except KeyboardInterrupt:  # Ctrl-C: the candidates planned so far are kept (dpmem plan writes them)
        interrupted = True
    if not interrupted:
        base_mistake(rows, refused)
        if not rows:  # nothing planned: the refusals are why, not the budget
            raise ConfigError("plan.candidates", "every candidate was refused: " + "; ".join(
                f"{r['configuration']}: {r['why']}" for r in refused))
    refused = [{k: r[k] for k in ("configuration", "why")} for r in refused]  # the error objects stay here
    asked = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "method"), None)  # `method=NAME`
    return {"device": dataclasses.asdict(device), "budget_bytes": budget, "batch_size": base.train.batch_size,
            "model": base.model.name, "data": base.data.name, "precisions": list(precisions),
            "rows": rank(rows, asked), "refused": refused,
            "ranking": RANKING.format(asked=f"the method asked for (method={asked}) first, then " if asked else ""),
            "bands_rule": BANDS_RULE if any(r["bands"] for r in rows) else None,
            "interrupted": interrupted}


def check_reachable(cfg) -> None:
    """The base config's privacy.epsilon, calibrated once before any candidate is planned: a budget no noise meets
    (or one so loose it protects nothing) is refused under its key at once, not after every candidate."""
    if cfg.privacy.epsilon is None or not method_class(cfg.method.name).spec.private:
        return
    event, steps = accounting_of(cfg)
    if event.accountant == "rc":
        return
    try:
        event.calibrated(cfg.privacy.epsilon, steps)
    except UnreachableTarget as e:
        raise ConfigError("privacy.epsilon", str(e)) from None


def size_text(n: float) -> str:
    """A size in the largest binary unit it reaches: 24 GiB, 3 MiB, 100 KiB."""
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if n >= s), ("B", 1))
    return f"{n / scale:.3g} {unit}"


def host_memory() -> int:
    """This host's RAM in bytes (the budget of a plan for plan.device=cpu when memory.budget is not given)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def nothing_fits(rows: list[dict], budget: int) -> ConfigError:
    """The refusal of a plan in which no planned candidate fits `budget` (`choose` refuses one where none was
    planned): the smallest peak, and where it was planned."""
    smallest = min(rows, key=lambda r: r["reserved_estimate_bytes"])
    fewer = max((r for r in rows if r["bands"] and r["bands"]["largest"]), key=lambda r: r["bands"]["largest"],
                default=None)  # bandmf: a row that fits with fewer bands
    bands = (f"; with privacy.bands ≤ {fewer['bands']['largest']} (not {fewer['bands']['planned']}), "
             f"{fewer['configuration']} fits at physical batch 1" if fewer else
             "; bandmf's noise buffers included: not even privacy.bands=2 fits" if smallest["bands"] else "")
    return ConfigError("memory.budget", f"nothing fits {size_text(budget)}: the smallest peak is ≥ "
                       f"{size_text(smallest['peak_bytes'])} (reserved estimate ≥ "
                       f"{size_text(smallest['reserved_estimate_bytes'])}), {smallest['configuration']} at physical "
                       f"batch 1{bands}")
