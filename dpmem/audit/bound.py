"""The empirical lower bound on epsilon of one-run auditing (Steinke, Nasr, Jagielski, NeurIPS 2023, "Privacy auditing
with one (1) training run", arXiv 2305.08846).

m canaries, each included independently with probability ½. An auditor guesses r of them (the top-k scores "in",
the bottom-k "out", abstaining on the rest) and gets v right. If the training run is (ε, δ)-DP, then (their
Theorem 5.2, with its δ term)

    P[V ≥ v] ≤ P[Binomial(r, p) ≥ v] + 2mδ · max_{i = 1..v} P[v − i ≤ Binomial(r, p) < v] / i,   p = e^ε / (1 + e^ε),

so a count v whose right-hand side is below β rules out (ε, δ)-DP at confidence 1 − β, for any guesses made from the
scores alone (`audit_bound` says which guesses are tried).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

MIN_GROUP = 50  # canaries a weight needs for guesses among its own: fewer cannot rule out ε = 2 at 95 %
GROUP_SHARE = 0.1  # and the share of all: each group tried costs every guess some confidence (the union bound)
NOISE_LEVEL = 1e-6  # the noise check's false alarm rate: it is tight, so at 5 % it would flag 1 correct run in 20


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The probability, under (epsilon, delta)-DP, of v or more right guesses out of r (m canaries)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    p = 1.0 / (1.0 + math.exp(-epsilon))  # the accuracy of epsilon-DP randomized response
    tail = float(stats.binom.sf(v - 1, r, p))
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    return min(tail + 2 * m * delta * _largest_mean_below(r, v, p), 1.0)


def _largest_mean_below(r: int, v: int, p: float) -> float:
    """max_{i = 1..v} P[v − i ≤ Binomial(r, p) < v] / i, exactly, from its first n terms: every later one is below
    P[B < v] / n, so once the maximum so far reaches that none can pass it. n grows from 1,024 by 16 times: at most
    a few thousand terms where all v (tens of thousands, at each step of the bisection) were computed."""
    below_v = float(stats.binom.cdf(v - 1, r, p))
    n = min(v, 1024)
    while True:
        below = stats.binom.pmf(np.arange(v - 1, v - 1 - n, -1), r, p)  # P[B = v-1], ..., P[B = v-n]
        alpha = float(np.max(np.cumsum(below) / np.arange(1, n + 1)))
        if n == v or alpha >= below_v / n:
            return alpha
        n = min(v, 16 * n)


def epsilon_lower_bound(m: int, r: int, v: int, beta: float, delta: float, iterations: int = 60) -> float:
    """The largest epsilon that v right guesses out of r rule out at confidence 1 - beta (0 when none is)."""
    if not 0 < beta < 1:
        raise ValueError(f"beta={beta} must be in (0, 1)")
    if p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < beta:  # p_value grows with epsilon; v = r caps it at log((1-β)/β)/…
        lo, hi = hi, 2 * hi
        if hi > 1e3:
            return math.inf
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_value(m, r, v, mid, delta) < beta else (lo, mid)
    return lo


def default_guess_sizes(m: int) -> list[int]:
    """k (guessed in, and as many guessed out) from a few canaries to all of them."""
    fractions = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
    return sorted({max(1, int(f * m)) for f in fractions if max(1, int(f * m)) <= m // 2})


def audit_bound(scores, included, delta: float, beta: float = 0.05, ks: list[int] | None = None,
                groups=None) -> dict:
    """The one-run lower bound from canary `scores` (higher: more likely in) and who was `included`.

    For each k the k highest scores are guessed in, and the k lowest out or none (for a fault that lifts some
    canaries and leaves the rest as they were), among all canaries and, with `groups` (a label per canary, fixed
    before any ran: the weight each lives in), among each group of at least MIN_GROUP alone, abstaining on the rest:
    a fault in one weight moves its own canaries, whose guesses the others' would dilute. Each guess is tested at
    beta over the number of guesses tried (a union bound), so the maximum over them holds at confidence 1 - beta."""
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    m = len(scores)
    if m < 2 or included.shape != scores.shape:
        raise ValueError(f"need at least 2 canaries and one inclusion bit per score (got {m}, {included.shape})")
    if ks is not None and any(not 1 <= k <= m // 2 for k in ks):
        raise ValueError(f"guess sizes {ks} must lie in [1, m/2 = {m // 2}]")
    order = np.argsort(-scores, kind="stable")  # highest first (a group's canaries in the same order among them)
    among = {"all": order}
    if groups is not None:
        labels = np.asarray(groups)
        values, counts = np.unique(labels, return_counts=True)
        among.update((str(g), order[labels[order] == g]) for g, count in zip(values.tolist(), counts)
                     if max(MIN_GROUP, GROUP_SHARE * m) <= count < m)
    guesses = [(name, k, out) for name, ranked in among.items()
               for k in (ks if ks is not None and name == "all" else default_guess_sizes(len(ranked)))
               for out in (k, 0)]  # the bottom k guessed out too, or abstained on
    rows = []
    for name, k, out in guesses:
        ranked = among[name]
        v = int(included[ranked[:k]].sum() + (~included[ranked[len(ranked) - out:]]).sum())
        rows.append({"among": name, "k": k, "out": out, "guesses": k + out, "correct": v,
                     "epsilon": epsilon_lower_bound(m, k + out, v, beta / len(guesses), delta)})
    best = max(rows, key=lambda row: row["epsilon"])
    return {"epsilon_lower_bound": best["epsilon"], "k": best["k"], "out": best["out"], "among": best["among"],
            "guesses": best["guesses"], "correct": best["correct"], "canaries": m, "included": int(included.sum()),
            "beta": beta, "delta": delta, "by_k": rows}


def whole_noise_check(step_squares, sizes: list[int], sigma: float | None, names: list[str] | None = None,
                      level: float = NOISE_LEVEL, differences=None) -> dict:
    """`noise_check` over every coordinate of every released tensor and every step: `step_squares[t][p]` is Σ u²
    over tensor p's `sizes[p]` coordinates at step t, u the releases un-correlated by the claimed strategy
    (`canaries.Whitening`: u = C y, the release itself for independent noise), in the units of `noise_check`. Under
    the claim u_t = a_t + σz_t, z_t standard normal and fresh, a_t (the clipped sums through C) fixed by the earlier
    steps and the step's batch, so E[u_t² | past] = a_t² + σ² ≥ σ² and each sum over σ² is at least a χ² of its count
    in law, its lower tail a one-sided p-value:

    - per tensor, over all steps (χ² of T·d): a tensor released with less noise than σC on every step;
    - per step, over all tensors (χ² of D, every coordinate): a step released with too little noise, or none, even
      one step in hundreds;
    - per pair of consecutive steps (`differences[t − 1]`, Σ (u_t − u_{t−1})² over every coordinate): u_{t−1} is
      fixed by the past too, so the same bound holds (a correct run reads about √2, both steps' noise); a step that
      repeats the last one's noise (true ε ∞: the two releases' difference is noise-free) reads its clipped sums'
      change alone. The signal's own correlation across steps cannot raise a false alarm: it only adds variance.

    Each family is Bonferroni-corrected (`level` over the number of tensors, of steps, of pairs): a correct run is
    flagged with probability at most 3·`level`. Costs two passes of squares over the released gradient per step,
    a float per tensor, and copies of the gradient: the last release (`differences`), and for correlated noise the
    strategy's b − 1 (bandmf) or p − 1 (bisr) last values (`Whitening`), as many as bandmf's own buffers."""
    if not sigma or not len(step_squares):
        return {"whole_noise_flagged": False, "worst_tensor": None, "worst_tensor_ratio": None,
                "worst_tensor_p_value": None, "worst_step": None, "worst_step_ratio": None,
                "worst_step_p_value": None, "worst_difference": None, "worst_difference_ratio": None,
                "worst_difference_p_value": None}
    squares = np.asarray(step_squares, dtype=np.float64) / sigma ** 2  # steps × tensors
    sizes = np.asarray(sizes, dtype=np.float64)
    steps = squares.shape[0]
    per_tensor = stats.chi2.cdf(squares.sum(0), steps * sizes)
    per_step = stats.chi2.cdf(squares.sum(1), sizes.sum())
    p, t = int(np.argmin(per_tensor)), int(np.argmin(per_step))
    flagged = bool(per_tensor[p] < level / len(sizes) or per_step[t] < level / steps)
    record = {"worst_tensor": names[p] if names else p,
              "worst_tensor_ratio": math.sqrt(squares[:, p].sum() / (steps * sizes[p])),
              "worst_tensor_p_value": float(per_tensor[p]), "worst_step": t,
              "worst_step_ratio": math.sqrt(squares[t].sum() / sizes.sum()), "worst_step_p_value": float(per_step[t]),
              "worst_difference": None, "worst_difference_ratio": None, "worst_difference_p_value": None}
    if differences is not None and len(differences):
        pairs = np.asarray(differences, dtype=np.float64) / sigma ** 2
        per_pair = stats.chi2.cdf(pairs, sizes.sum())
        d = int(np.argmin(per_pair))
        flagged = flagged or bool(per_pair[d] < level / len(pairs))
        record.update(worst_difference=d + 1, worst_difference_ratio=math.sqrt(pairs[d] / sizes.sum()),
                      worst_difference_p_value=float(per_pair[d]))
    return {"whole_noise_flagged": flagged, **record}


def correlation_check(cosines, dim: int, level: float = NOISE_LEVEL) -> dict:
    """Whether the noise is fresh at every step: `cosines[t][l − 1]` is the cosine between the noise vectors of
    steps t and t − l (lags l = 1 up to the strategy's bands, b; 1 for independent noise), each of `dim` values:
    the left-out canaries', where the release less the real samples' clipped sum is the noise alone, un-correlated
    by the claimed strategy (`canaries.Whitening`), so σz under the claim, z standard normal and fresh each step.
    The signal, whose own correlation across steps would confound a test on the releases, is not in them.

    Given the earlier steps, z_t's direction is uniform on the sphere, so r = cos(z_t, z_{t−l}) has the exact law
    of a sample correlation of `dim` values: t = r·√(dim − 1)/√(1 − r²) is Student's t with dim − 1 degrees of
    freedom, whatever σ. Two families, two-sided, each Bonferroni-corrected at `level` (a correct run is flagged
    with probability at most 2·`level`; no asymptotics):

    - per pair of steps and lag: one step's noise repeating another's (r = 1), or a large part of it;
    - per lag, over all steps: the pairs' t-values mapped to normal scores and summed (Stouffer): given the past
      each is exactly uniform, so over T − l pairs the sum is N(0, T − l): a small correlation on every step (a
      wrong strategy: bandmf's buffers dropped, a coefficient off) at power about that of the pooled correlation,
      r·√(dim·T).

    It needs at least 2 values a step (DPZero's one scalar has no direction: not tested)."""
    rows = [list(row) for row in cosines]
    lags = max((len(row) for row in rows), default=0)
    if dim < 2 or not lags:
        return {"correlation_flagged": False, "worst_lag": None, "worst_lag_correlation": None,
                "worst_lag_p_value": None, "worst_pair": None, "worst_pair_correlation": None,
                "worst_pair_p_value": None}
    r = np.full((len(rows), lags), np.nan)
    for t, row in enumerate(rows):
        r[t, :len(row)] = row
    r = np.clip(r, -1.0, 1.0)
    df = dim - 1
    with np.errstate(divide="ignore"):  # r = ±1: t = ±∞, p = 0
        tvalue = r * math.sqrt(df) / np.sqrt(1 - r ** 2)
    pair_p = 2 * stats.t.sf(np.abs(tvalue), df)
    # the normal score of each pair's exact p-value, from the nearer tail (Φ⁻¹ of a cdf near 1 loses its digits)
    scores = np.where(tvalue > 0, stats.norm.isf(stats.t.sf(tvalue, df)), stats.norm.ppf(stats.t.cdf(tvalue, df)))
    counts = np.isfinite(r).sum(0)
    pooled = np.nansum(scores, 0) / np.sqrt(np.maximum(counts, 1))
    lag_p = np.where(counts > 0, 2 * stats.norm.sf(np.abs(pooled)), 1.0)
    pairs = int(counts.sum())
    t, lag = np.unravel_index(np.nanargmin(pair_p), pair_p.shape)
    worst = int(np.argmin(lag_p))
    flagged = bool(pair_p[t, lag] < level / pairs or lag_p[worst] < level / lags)
    return {"correlation_flagged": flagged, "worst_lag": worst + 1,
            "worst_lag_correlation": float(np.nanmean(r[:, worst])), "worst_lag_p_value": float(lag_p[worst]),
            "worst_pair": [int(t - lag - 1), int(t)], "worst_pair_correlation": float(r[t, lag]),
            "worst_pair_p_value": float(pair_p[t, lag])}


def noise_check(squares: float, count: int, sigma: float | None, level: float = NOISE_LEVEL) -> dict:
    """Whether the release varies as much as the claimed noise: `squares` is the sum of `count` values y at
    coordinates no canary reached (the left-out canaries'): the release there less the real samples' clipped sum, in
    units of C/(q·n), un-correlated by the claimed strategy (`canaries.Whitening`: C times each coordinate's
    sequence; the values themselves for independent noise), so y = σz under the claim, z standard normal and fresh
    each step. (A strategy's noise σ(C⁻¹z)_i varies by σ²Σ_j (C⁻¹)²_ij, above σ², which would hide a cut.) Σ y² / σ²
    is then χ²(count), and its lower tail is a p-value for "the noise is the claimed σC"; below `level`, the run added
    less noise than it accounts for (per micro-batch, too small a scale, none). `noise_ratio`: the measured root mean
    square over σ, about 1 when correct."""
    if not count or not sigma:
        return {"noise_ratio": None, "noise_p_value": None, "noise_flagged": False}
    p = float(stats.chi2.cdf(squares / sigma**2, count))
    return {"noise_ratio": math.sqrt(squares / count) / sigma, "noise_p_value": p, "noise_flagged": p < level}
