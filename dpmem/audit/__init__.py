"""`dpmem audit` (docs/privacy.md, "Auditing"): train one run with m canaries, each in the training set with
probability ½, score them, and turn the scores into an empirical lower bound on epsilon (`dpmem.audit.bound`) and,
for gradient canaries, noise checks: noise below the claimed σC, which the bound lacks the power to see unless it
is much smaller, fails them."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from dpmem.audit.bound import audit_bound, correlation_check, noise_check, whole_noise_check
from dpmem.audit.canaries import BatchCanaries, GradientCanaries, InputCanaries, allowed, host_weights
from dpmem.config import ConfigError, accounted, enum_value
from dpmem.data import build_data
from dpmem.engine.assemble import assemble
from dpmem.engine.summary import json_ready
from dpmem.engine.trainer import Run
from dpmem.methods import method_class
from dpmem.models import build_model
from dpmem.privacy.record import PrivacyUnit
from dpmem.report import markdown_table


def run_audit(cfg, out: Path, mechanism_of=None) -> tuple[dict, str]:
    """Train `cfg` with canaries into out/run, write out/audit.json, audit.md and the scores figure.
    `mechanism_of(mechanism, model, canaries)`: a broken mechanism to use instead (`dpmem.audit.variants`)."""
    check(cfg)
    a, name = cfg.audit, cfg.method.name
    if (out / "run" / "checkpoint.pt").exists():
        # the canaries' scores live in this process: a resumed run would score only the steps after the crash
        raise ConfigError("train.checkpoint_every", "dpmem audit does not resume; run it without checkpoints, "
                          "into a fresh audit.dir")
    kind = enum_value(a.kind)
    plant = planting(cfg) if kind == "gradient" else None
    start = time.perf_counter()
    inputs = InputCanaries(a.canaries, a.seed) if kind == "input" else None
    norm = a.norm * cfg.method.max_grad_norm
    canaries = inputs or (BatchCanaries(a.canaries, norm, a.seed, a.uses) if plant == "batch"
                          else GradientCanaries(a.canaries, norm, a.seed))
    (out / "run").mkdir(parents=True, exist_ok=True)
    run = Run(cfg, out / "run", data_hook=inputs.plant if inputs else None,
              observers=() if inputs else (canaries,),
              mechanism_of=(lambda m, model: mechanism_of(m, model, canaries)) if mechanism_of else None)
    parts = run.prepare()
    if not inputs:  # the claimed strategy, which the noise checks un-correlate the releases by
        canaries.follow(parts.mechanism)
    summary = run.execute()
    if summary["status"] != "ok":
        raise RuntimeError(f"the audited run ended {summary['status']}: {summary['error']}")
    if inputs is not None:
        inputs.score(parts, batch=max(1, cfg.train.physical_batch_size or cfg.train.batch_size))
    mechanism = parts.mechanism
    gradient = isinstance(canaries, GradientCanaries)
    groups = canaries.groups() if gradient else None
    bound = audit_bound(canaries.scores.numpy(), canaries.included.numpy(), delta=mechanism.delta, beta=a.beta,
                        groups=groups.numpy() if groups is not None else None)
    noise = noise_check(canaries.noise_squares, canaries.noise_count, canaries.sigma) \
        if gradient else noise_check(0.0, 0, None)
    correlation = correlation_check(canaries.noise_cosines if gradient else [], getattr(canaries, "noise_dim", 0))
    names: dict[int, str] = {}  # a tied weight by all its names
    for n, q in parts.model.named_parameters(remove_duplicate=False):
        names[id(q)] = f"{names[id(q)]} = {n}" if id(q) in names else n
    whole = whole_noise_check(getattr(canaries, "step_squares", []), getattr(canaries, "tensor_sizes", []),
                              getattr(canaries, "sigma", None),
                              [names.get(id(k), str(k)) for k in getattr(canaries, "tensor_keys", [])],
                              differences=getattr(canaries, "step_differences", None))
    flagged = (bound["epsilon_lower_bound"] > summary["epsilon_spent"] or noise["noise_flagged"]
               or whole["whole_noise_flagged"] or correlation["correlation_flagged"])
    placed = getattr(canaries, "where", None) or {}  # gradient canaries: key -> (canary ids, flat indices)
    where = {names.get(id(key), str(key)): len(ids) for key, (ids, _) in placed.items()}
    record = {"method": name, "clipping": summary["clipping"], "model": cfg.model.name, "data": cfg.data.name,
              "kind": kind, "plant": plant, "uses": a.uses if plant == "batch" else None, "canaries_in": where,
              "untouched": getattr(canaries, "untouched", None),
              "physical_batch_size": cfg.train.physical_batch_size,
              "epsilon_claimed": summary["epsilon_spent"], "delta": mechanism.delta,
              "strategy": summary.get("noise"), "bands": summary.get("bands"),
              "sigma": summary["sigma"], "steps": summary["steps_done"], "sample_rate": mechanism.sample_rate,
              **bound, **noise, **whole, **correlation, "flagged": flagged, "confidence": 1 - a.beta,
              "seconds": time.perf_counter() - start,
              "scores": canaries.scores.tolist(), "in": canaries.included.tolist(), "run_dir": str(out / "run")}
    (out / "audit.json").write_text(json.dumps(json_ready(record), indent=1) + "\n")
    text = table([record])
    (out / "audit.md").write_text(text)
    figure(out, record)
    return record, text


def check(cfg) -> None:
    """The audit's own settings, refused before any folder is written (dpmem audit checks every point first)."""
    a, name = cfg.audit, cfg.method.name
    if not method_class(name).spec.private:
        raise ConfigError("method.name", f"{name} is not private: there is no claimed epsilon to audit")
    if not accounted(cfg.privacy):
        raise ConfigError("privacy", "privacy=none claims no epsilon to audit; choose a budget, e.g. privacy=eps2")
    if cfg.train.checkpoint_every:  # the canaries' scores live in one process (`run_audit`)
        raise ConfigError("train.checkpoint_every", "dpmem audit does not resume; run it without checkpoints, "
                          "into a fresh audit.dir")
    if enum_value(a.kind) == "input" and PrivacyUnit.of(cfg.privacy).user:
        raise ConfigError("audit.kind", "input canaries are records of no user; under privacy.unit=user the "
                          "canaries are users of k records: audit.kind=gradient")
    if not 0 < a.beta < 1:
        raise ConfigError("audit.beta", f"{a.beta} must be in (0, 1)")
    if a.canaries < 2:
        raise ConfigError("audit.canaries", f"{a.canaries}: need at least 2")
    if not (math.isfinite(a.norm) and a.norm > 0):  # a canary of norm <= 0 is no canary: it would audit epsilon >= 0
        raise ConfigError("audit.norm", f"{a.norm}: must be a finite number > 0 (a gradient canary's norm in units "
                          "of method.max_grad_norm; default 10)")


def check_room(cfg) -> None:
    """Each gradient canary takes a coordinate of its own: too many for the model refused before training, counted on
    the run's parts built without weights (meta). Batch canaries live in the weights `host_weights` finds; summed
    ones in what the method privatises (its `shapes`: grape's projections), or dpzero's direction (its parameters).
    `dpmem audit` asks it once per point (it builds the data and the model once more)."""
    if enum_value(cfg.audit.kind) != "gradient":
        return
    m, plant = cfg.audit.canaries, planting(cfg)
    meta = torch.device("meta")
    data = build_data(cfg.data, cfg.model)
    with meta:
        model = build_model(cfg.model, data, weights=False)
    method = assemble(cfg, meta, data, model).method
    trainable = [p for p in model.parameters() if p.requires_grad]
    if plant == "batch":
        room = sum(int(allowed(p, mods).sum()) for p, mods in host_weights(model, set(trainable)).items())
        where = "the nn.Linear and nn.Embedding weights batch canaries are made through"
    else:
        shapes = getattr(method, "shapes", None) or {p: p.shape for p in trainable}
        room = sum(torch.Size(s).numel() for s in shapes.values())
        where = f"what {cfg.method.name} privatises"
    method.close()
    if m > room:
        raise ConfigError("audit.canaries", f"{m} canaries need a coordinate each; model={cfg.model.name} has "
                          f"{room} in {where}: allowed 2..{room}")


def planting(cfg) -> str:
    """Where gradient canaries join the step: audit.plant, with auto resolved to batch where the method's Privatizer
    forms unprojected clipped sums in one process (dp-adam, dp-sgd, galore-dp-naive, dp-sgd-rc), else sum."""
    plant, able = enum_value(cfg.audit.plant), method_class(cfg.method.name).spec.privatised_gradient
    if plant == "batch" and not able:
        raise ConfigError("audit.plant", f"{cfg.method.name} privatises no unprojected clipped sum for canaries to "
                          "join as samples; use audit.plant=sum (or auto)")
    if plant == "batch" and cfg.train.fsdp:
        raise ConfigError("audit.plant", "FSDP's layers cannot be called alone; use audit.plant=sum (or auto)")
    if cfg.audit.uses < 1:
        raise ConfigError("audit.uses", f"{cfg.audit.uses}: need at least 1")
    user = PrivacyUnit.of(cfg.privacy).user
    if plant == "batch" and user:
        raise ConfigError("audit.plant", "a canary of privacy.unit=user is a user of k records, planted in the "
                          "clipped sum through the run's per-user clipping; use audit.plant=sum (or auto)")
    if plant != "auto":
        return plant
    return "batch" if able and not cfg.train.fsdp and not user else "sum"


def table(records: list[dict]) -> str:
    confidence = " / ".join(sorted({f"{r['confidence']:.0%}" for r in records}))
    rows = []
    for r in records:
        kind = f"{r['kind']} ({r['plant']})" if r.get("plant") else r["kind"]
        noise = "—" if r.get("noise_ratio") is None else f"{r['noise_ratio']:.3f} ({r['noise_p_value']:.2g})"
        rows.append([r["method"], r["clipping"] or "—", kind, str(r["canaries"]), f"{r['epsilon_claimed']:.3g}",
                     f"{r['delta']:.2g}", strategy_cell(r), f"{r['epsilon_lower_bound']:.3f}", str(r["k"]),
                     f"{r['correct']} / {r['guesses']}", noise, whole_noise_cell(r), correlation_cell(r),
                     f"{r['seconds']:.0f}"])
    head = ["method", "clipping", "canaries (plant)", "m", "claimed ε", "δ", "noise", f"audited ε ≥ ({confidence})",
            "k", "correct / guesses", "noise / claimed (p)", "least-noised tensor, step, step pair / claimed",
            "noise correlation (p)", "time (s)"]
    return "\n".join(markdown_table(head, rows)) + "\n"


def strategy_cell(r: dict) -> str:
    """The claimed noise: independent, or a correlated strategy with its bands."""
    return f"{r['strategy']} ({r['bands']})" if r.get("bands") else r.get("strategy") or "—"


def whole_noise_cell(r: dict) -> str:
    """The whole model's noise check (`bound.whole_noise_check`): the least-noised tensor, step and step pair."""
    if r.get("worst_tensor_ratio") is None:
        return "—"
    pair = ("" if r.get("worst_difference") is None else
            f", {r['worst_difference_ratio']:.3f} (steps {r['worst_difference'] - 1}–{r['worst_difference']})")
    return (f"{r['worst_tensor_ratio']:.3f} ({r['worst_tensor']}), {r['worst_step_ratio']:.3f} (step "
            f"{r['worst_step']}){pair}" + (" flagged" if r["whole_noise_flagged"] else ""))


def correlation_cell(r: dict) -> str:
    """The noise correlation check (`bound.correlation_check`): the worst lag over all steps, the worst pair."""
    if r.get("worst_lag") is None:
        return "—"
    a, b = r["worst_pair"]
    return (f"lag {r['worst_lag']}: {r['worst_lag_correlation']:.3f} ({r['worst_lag_p_value']:.2g}); steps {a}–{b}: "
            f"{r['worst_pair_correlation']:.2f} ({r['worst_pair_p_value']:.2g})"
            + (" flagged" if r["correlation_flagged"] else ""))


def figure(out: Path, record: dict) -> None:
    from dpmem.report import pyplot, save_figure

    scores, included = torch.tensor(record["scores"]), torch.tensor(record["in"])
    fig, ax = pyplot().subplots(figsize=(6, 4))
    bins = torch.linspace(float(scores.min()), float(scores.max()) + 1e-12, 41).tolist()
    ax.hist(scores[included].tolist(), bins=bins, alpha=0.6, label="in")
    ax.hist(scores[~included].tolist(), bins=bins, alpha=0.6, label="out")
    eps = record["epsilon_claimed"]
    ax.set(xlabel="canary score", ylabel="canaries", title=f"{record['method']}: claimed ε = "
           f"{eps if math.isinf(eps) else round(eps, 3)}, audited ε ≥ {record['epsilon_lower_bound']:.3f}")
    ax.legend()
    save_figure(fig, out, "scores")
