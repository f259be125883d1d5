"""The generalized geometric median of Li et al. 2022 (§4.1, App. A; "When Does Differentially Private Learning Not
Suffer in High Dimensions?"), generated for a dimension d and a metric A, seeded, no files:

    F(β) = (1/n) Σᵢ ‖β − xᵢ‖_A + (α/2)‖β − β⁽⁰⁾‖²,   ‖v‖_A = √(vᵀAv),   β⁽⁰⁾ = 0

with A = diag(1, …, 1) (const), diag(1, 1/√2, …, 1/√d) (sqr) or diag(1, 1/2, …, 1/d) (linear). Each xᵢ has its
first d_min coordinates drawn N(1, 1) and the rest 0, so min F is the same for every d ≥ d_min (the minimiser is 0
beyond d_min) and only DP-SGD's noise in the extra coordinates can make the excess loss grow with d. Training and
test draws are independent, n each; `split_seed` seeds both (another seed is another draw, e.g. for tuning).

The model is the bare vector β (`dpmem.models.median`); its scores are F(β) − min F on each draw (`minimum`)."""

from __future__ import annotations

import torch

from dpmem.config import ConfigError
from dpmem.data.bundle import DataBundle

METRICS = ("const", "sqr", "linear")
TOLERANCE = 1e-13  # the fixed point's step in β at which min F is taken as found


def diagonal(kind: str, d: int) -> torch.Tensor:
    """A's diagonal: 1, 1/√k or 1/k for k = 1..d (float64)."""
    k = torch.arange(1, d + 1, dtype=torch.float64)
    return {"const": torch.ones(d, dtype=torch.float64), "sqr": k.rsqrt(), "linear": 1 / k}[kind]


def head_distances(beta: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """‖β − xᵢ‖_A for every row of x, which holds only the first d_min coordinates (the rest are 0)."""
    m = x.shape[1]
    diff = beta[:m].to(x.dtype) - x
    tail = (a[m:] * beta[m:].to(x.dtype) ** 2).sum()
    return ((a[:m] * diff ** 2).sum(1) + tail).sqrt()


def objective(beta: torch.Tensor, x: torch.Tensor, a: torch.Tensor, alpha: float) -> float:
    """F(β) in float64."""
    beta = beta.detach().double()
    return float(head_distances(beta, x, a).mean() + alpha / 2 * beta.pow(2).sum())


def minimum(x: torch.Tensor, a: torch.Tensor, alpha: float, iterations: int = 100_000) -> tuple[torch.Tensor, float]:
    """(argmin F, min F) by Weiszfeld's fixed point for ‖·‖_A with the ridge term: β_k = Σᵢ wᵢ a_k x_ik /
    (a_k Σᵢ wᵢ + nα), wᵢ = 1/‖β − xᵢ‖_A, on the first d_min coordinates (the minimiser is 0 beyond them). Each step
    does not increase F (a majorize-minimize step); it starts at the mean."""
    m, n = x.shape[1], len(x)
    a_head = a[:m]
    beta = torch.zeros(len(a), dtype=torch.float64)
    beta[:m] = x.mean(0)
    for _ in range(iterations):
        w = 1 / head_distances(beta, x, a).clamp_min(1e-300)
        new = (a_head * (w[:, None] * x).sum(0)) / (a_head * w.sum() + n * alpha)
        step = float((new - beta[:m]).abs().max())
        beta[:m] = new
        if step < TOLERANCE:
            break
    return beta, objective(beta, x, a, alpha)


def load(cfg) -> DataBundle:
    if cfg.A not in METRICS:
        raise ConfigError("data.A", f"{cfg.A!r}: allowed {', '.join(METRICS)}")
    if cfg.d_min < 1 or cfg.dimension < cfg.d_min:
        raise ConfigError("data.dimension", f"{cfg.dimension} with d_min={cfg.d_min}: need 1 <= d_min <= dimension")
    if not cfg.n_train or cfg.n_train < 2 or not cfg.n_test or cfg.n_test < 2:
        raise ConfigError("data.n_train", f"n_train={cfg.n_train}, n_test={cfg.n_test}: need at least 2 each")
    if not cfg.alpha >= 0:
        raise ConfigError("data.alpha", f"{cfg.alpha} must be >= 0")
    gen = torch.Generator().manual_seed(cfg.split_seed)
    draw = lambda n: torch.randn(n, cfg.d_min, generator=gen, dtype=torch.float64) + 1  # noqa: E731
    x_train, x_test = draw(cfg.n_train), draw(cfg.n_test)
    a, alpha = diagonal(cfg.A, cfg.dimension), float(cfg.alpha)
    lowest = {"train": minimum(x_train, a, alpha)[1], "test": minimum(x_test, a, alpha)[1]}

    def score(model, device, batch_size, autocast) -> dict:
        beta = model.beta.detach().double().cpu()
        return {"excess_empirical_loss": objective(beta, x_train, a, alpha) - lowest["train"],
                "excess_population_loss": objective(beta, x_test, a, alpha) - lowest["test"]}

    def per_sample_loss(model, batch):
        return model(batch["x"])

    return DataBundle({"x": x_train.float()}, {"x": x_test.float()}, num_classes=0, input_shape=(cfg.dimension,),
                      per_sample_loss=per_sample_loss, predict=None, metric_name="excess_empirical_loss",
                      score=score, problem={"A": a.float(), "alpha": alpha})
