"""`dpmem spectrum mode=layer` (DP-GRAPE Fig. 1; docs/reproductions.md): the top singular values of each projected
layer's batch gradient, raw and privatised as a DP method privatises it (flat clipping at C, then
`GaussianMechanism.release`, the code every private method uses). Every setting (C, σ) sees the same batch, the same
per-sample gradients and the same noise draw z (scaled by σ·C), so the curves differ only by clipping and noise.
Without clipping (C = ∞) no noise is added: its scale σ·C would be infinite."""

from __future__ import annotations

import torch

from dpmem.config import ConfigError, GrapeConfig
from dpmem.data.bundle import real_size, weights
from dpmem.engine.trainer import Run
from dpmem.methods.projected_adam import choose_projected
from dpmem.persample import Taps, clip_factors, per_sample_norms, weighted_sum_of
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, seed_key
from dpmem.spectrum.linalg import power_law_slope, top_singular_values
from dpmem.spectrum.not_private import mark_not_private

Setting = tuple[float | None, float]  # (C, sigma); C None = no clipping


def settings(sp, max_grad_norm: float | None, sigma: float) -> list[Setting]:
    """(C, σ) pairs: spectrum.clip × spectrum.sigma (defaults: no clipping and method.max_grad_norm; 0 and the
    σ the privacy config gives), with C = ∞ only at σ = 0."""
    clips = list(sp.clip) if sp.clip is not None else [None] + ([max_grad_norm] if max_grad_norm else [])
    sigmas = list(sp.sigma) if sp.sigma is not None else [0.0] + ([sigma] if sigma > 0 else [])
    for c in clips:
        if c is not None and not c > 0:
            raise ConfigError("spectrum.clip", f"{c}: clipping thresholds must be > 0 (null = no clipping)")
    for s in sigmas:
        if not s >= 0:
            raise ConfigError("spectrum.sigma", f"{s}: noise multipliers must be >= 0")
    return list(dict.fromkeys((c, float(s)) for c in clips for s in ([0.0] if c is None else sigmas)))


def measure(model, microbatches, loss_fn, layers: dict[str, torch.nn.Parameter], chosen: list[Setting],
            expected_batch_size: float, top: int, seed: int) -> list[dict]:
    """Per setting: {clip, sigma, label, per_layer: {name: top singular values}, mean, mean_normalized, slope}."""
    taps = Taps(model)
    clips = list(dict.fromkeys(c for c, _ in chosen))
    sums = {c: {n: torch.zeros_like(p) for n, p in layers.items()} for c in clips}
    try:
        for mb in microbatches:
            grads = taps.gradients(lambda: loss_fn(model, mb).sum(), len(next(iter(mb.values()))))
            norms = per_sample_norms(grads)
            for c in clips:
                factors = (torch.ones_like(norms) if c is None else clip_factors(norms, c)) * weights(mb)
                for n, p in layers.items():
                    sums[c][n] += weighted_sum_of(grads[p], factors)
            del grads
    finally:
        taps.close()
    results = []
    for c, s in chosen:
        # the same z for every setting: draws keyed by one seed, from the first
        draws = Draws(seed_key(seed), "noise", next(iter(layers.values())).device)
        mechanism = GaussianMechanism(sigma=s, max_grad_norm=c if c is not None else 1.0,
                                      expected_batch_size=expected_batch_size, draws=draws)
        private = mechanism.release({n: g.clone() for n, g in sums[c].items()})
        per_layer = {n: top_singular_values(g.reshape(g.shape[0], -1), top) for n, g in private.items()}
        results.append(summarise(c, s, per_layer))
    return results


def summarise(c, s, per_layer: dict[str, torch.Tensor]) -> dict:
    """The layers' spectra averaged rank by rank (over the ranks every layer has), raw and each divided by its
    layer's largest singular value (the shape of the decay, free of the layers' scales)."""
    n = min(len(v) for v in per_layer.values())
    stacked = torch.stack([v[:n] for v in per_layer.values()])
    mean = stacked.mean(0)
    normalized = (stacked / stacked[:, :1].clamp(min=1e-300)).mean(0)
    slope, _ = power_law_slope(mean)
    return {"clip": c, "sigma": s, "label": "no clipping" if c is None else f"C = {c:g}, sigma = {s:g}",
            "mean": mean.tolist(), "mean_normalized": normalized.tolist(), "slope": slope,
            "per_layer": {name: v.tolist() for name, v in per_layer.items()}}


def run_layer_mode(cfg, out) -> dict:
    """Train up to the last of spectrum.steps with the configured method, measuring before each listed step."""
    sp, m = cfg.spectrum, cfg.method
    steps = sorted(set(sp.steps))
    run = Run(cfg, out)
    parts = run.prepare()
    mark_not_private(run, "layer")
    calibrated, model = parts.mechanism, parts.model
    if steps[-1] > run.steps:
        raise ConfigError("spectrum.steps", f"{steps[-1]} is beyond the run's {run.steps} steps")
    chosen = settings(sp, m.max_grad_norm if calibrated.private else None, calibrated.sigma)
    sides = choose_projected(model, sp.layers, GrapeConfig.rank, key="spectrum.layers")
    names = {p: n for n, p in model.named_parameters()}
    layers = {names[p]: p for p in sides}
    if not layers:
        raise ConfigError("spectrum.layers", f"{cfg.model.name} has no trained matrix with both sides > "
                          f"{GrapeConfig.rank} to measure")
    measured = []
    for index, micro in run.steps_on_device():
        step = index + 1
        if step in steps:
            with parts.autocast():
                rows = measure(model, micro, parts.per_sample_loss, layers, chosen,
                               calibrated.expected_batch_size, sp.top, sp.seed)
            measured.append({"step": step, "batch_size": sum(real_size(mb) for mb in micro), "settings": rows})
        if step == steps[-1]:
            break
        run.train_step(index, micro)
    run.finish("ok", steps_done=steps[-1] - 1)  # the updates between measurements
    return {"mode": "layer", "model": cfg.model.name, "data": cfg.data.name, "method": m.name,
            "sigma_from_privacy": calibrated.sigma, "expected_batch_size": calibrated.expected_batch_size,
            "top": sp.top, "layers": list(layers), "steps": measured}
