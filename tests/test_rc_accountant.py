"""DP-SGD-RC accounting against independent oracles: scipy's χ² laws and quad, Monte Carlo, dp-accounting's
Gaussian PLD accountant, and the paper's noise multipliers."""

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_mechanism as plm
from scipy import integrate, stats

from dpmem.privacy import calibrate_sigma, envelope_cdf, epsilon_spent, x_plus
from dpmem.privacy import rc_envelope as rc
from dpmem.privacy.accounting import PLD_DISCRETIZATION

# DP-SGD-RC (Efficient DP-SGD for LLMs with Randomized Clipping) Table 4 (BBC, full fine-tuning): eps 0.7, delta 1e-5,
# batch 64, 10 epochs, Poisson rate 64/N. N = 1127 is where the DP-SGD (pld) noise multiplier is the paper's 4.073
# (found by scanning N; 1130 gives 4.0735).
N_BBC = 1127
Q_BBC, STEPS_BBC, EPS_BBC, DELTA_BBC = 64 / N_BBC, round(10 * N_BBC / 64), 0.7, 1e-5


def chi2_mean(x, n):
    return stats.chi2.cdf(n * np.asarray(x), n)


def quad_two_level(x, lam, i, j, k):
    """P(lam·χ²(ik)/(ik) + (1-lam)·χ²(jk)/(jk) ≤ x) by scipy quad: an oracle independent of rc's quadrature."""
    u, v = stats.chi2(i * k, scale=1 / (i * k)), stats.chi2(j * k, scale=1 / (j * k))
    return integrate.quad(lambda t: u.pdf(t) * v.cdf((x - lam * t) / (1 - lam)), 0, x / lam, points=[1.0],
                          limit=200, epsabs=1e-14, epsrel=1e-12)[0]


@pytest.mark.parametrize("k,d", [(1, 2), (2, 4), (4, 8), (32, 2048)])
@pytest.mark.parametrize("estimator", ["hutch", "hutchpp"])
def test_envelope_is_a_cdf(k, d, estimator):
    xp = x_plus(k, d)
    x = np.sort(np.concatenate([np.linspace(0.01, 3, 200), np.linspace(1, xp, 9)[1:-1]]))
    f = envelope_cdf(x, k, d, estimator)
    assert np.all(np.diff(f) >= -1e-12) and 0 <= f.min() and f.max() <= 1


@pytest.mark.parametrize("k,d", [(1, 2), (2, 4), (4, 8), (32, 2048), (8, 10 ** 7)])
def test_envelope_is_the_extremal_chi2_law_outside_the_middle_region(k, d):
    xp = x_plus(k, d)
    assert 1 < xp <= 2
    below, above = np.linspace(0.05, 1, 40), xp * np.linspace(1, 1.5, 40)
    np.testing.assert_allclose(envelope_cdf(below, k, d), chi2_mean(below, k), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(envelope_cdf(above, k, d), chi2_mean(above, k * d), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("k,d", [(1, 2), (2, 4), (32, 8)])
def test_middle_region_is_above_both_extremes(k, d):
    xp = x_plus(k, d)
    x = np.linspace(1, xp, 7)[1:-1]
    f, fe, fu = envelope_cdf(x, k, d), chi2_mean(x, k), chi2_mean(x, k * d)
    assert np.all(f >= np.maximum(fe, fu) - 1e-12)
    assert np.any(f > np.maximum(fe, fu) + 1e-4)  # the region is real: a mixture beats both extremes


def test_hutchpp_envelope_is_min_of_chi2_and_one():
    x = np.linspace(0.01, 3, 300)
    for k, d in [(1, 1), (4, 64), (32, 2048)]:
        want = np.maximum(chi2_mean(x, k), (x >= 1).astype(float))
        np.testing.assert_allclose(envelope_cdf(x, k, d, "hutchpp"), want, rtol=1e-12)
        # the d -> inf limit bounds the Hutch envelope from above
        assert np.all(envelope_cdf(x, k, d, "hutch") <= want + 1e-12)


def test_monte_carlo_cdfs_lie_below_the_envelope():
    """X(λ) = Σ λ_j χ²_j(k)/k for random and structured λ: the empirical CDF never exceeds the envelope (5 MC
    standard errors), and the extremal λ = e (x ≤ 1) and u (x ≥ x₊) attain it."""
    k, d, n = 2, 4, 200_000
    rng = np.random.default_rng(0)
    lams = [rng.dirichlet(np.ones(d)) for _ in range(3)] + [np.array([0.4, 0.2, 0.2, 0.2]),
                                                              np.array([0.5, 0.5, 0, 0])]
    e, u = np.eye(d)[0], np.full(d, 1 / d)
    xp = x_plus(k, d)
    x = np.concatenate([np.linspace(0.2, 1, 9), np.linspace(1, xp, 6)[1:], np.linspace(xp, 3, 8)])
    env = envelope_cdf(x, k, d)
    tol = 5 * np.sqrt(env * (1 - env) / n) + 1e-12
    for lam in lams + [e, u]:
        sample = rng.chisquare(k, size=(n, d)) @ lam / k
        ecdf = (sample[:, None] <= x).mean(axis=0)
        assert np.all(ecdf <= env + tol), lam
        if lam is e:
            np.testing.assert_array_less(np.abs(ecdf - env)[x <= 1], tol[x <= 1])
        if lam is u:
            np.testing.assert_array_less(np.abs(ecdf - env)[x >= xp], tol[x >= xp])


def test_two_level_cdf_matches_quad():
    for x, lam, i, j, k in [(1.02, 0.3, 1, 1, 32), (1.0, 0.5, 1, 3, 1), (1.3, 0.1, 2, 5, 1), (1.001, 0.9, 1, 500, 32),
                            (1.01, 0.01, 1, 2047, 32), (0.9, 0.5, 3, 3, 2)]:
        assert rc.two_level_cdf(x, lam, i, j, k)[0] == pytest.approx(quad_two_level(x, lam, i, j, k), abs=1e-10)


@pytest.mark.parametrize("k", [64, 128, 256])
def test_x_plus_is_one_plus_two_over_dk_for_d_2(k):
    """u stops being a local maximum exactly at 1 + 2/(dk) (rc module docstring), so x₊ ≥ that; for d = 2 no far
    configuration outlives it, and the bisection's relative tolerance is 1e-6 on x₊ - 1: hence 1e-5."""
    assert (x_plus(k, 2) - 1) * 2 * k == pytest.approx(2, rel=1e-5)


def test_x_plus_exceeds_two_over_dk_from_d_3_on():
    """The DP-SGD-RC paper reports (x₊ - 1)·dk ≈ 2 for all d; already at d = 3 a far configuration (one spike λ = 0.48,
    two at 0.26) beats u above 1 + 2/(dk), checked with quad, and x₊ itself exceeds the crossing of e with u, which
    grows like 0.67·√d / (dk)."""
    k, d = 64, 3
    x = 1 + 2.05 / (d * k)
    assert quad_two_level(x, 0.48, 1, 2, k) > chi2_mean(x, k * d) + 1e-5
    assert (x_plus(k, d) - 1) * d * k == pytest.approx(2.108, abs=2e-3)
    for d in (64, 2048):
        crossing = 1 + 0.6 * math.sqrt(d) / (d * 32)
        assert chi2_mean(crossing, 32) > chi2_mean(crossing, 32 * d)  # e still beats u there
        assert x_plus(32, d) > crossing


@pytest.mark.parametrize("k,d", [(4, 12), (32, 16)])
def test_one_spike_is_the_maximiser_beyond_the_exhaustive_search(k, d):
    """Above EXHAUSTIVE_D only (1, d-1) is searched: check against all two-level configurations around x₊."""
    xp = x_plus(k, d)
    for x, beats_u in [(1 + 0.9 * (xp - 1), True), (xp * (1 + 1e-6), False)]:
        best = max(rc._best_lambda(x, i, j, k) for i in range(1, d + 1) for j in range(i, d - i + 1))
        assert best == pytest.approx(rc._best_lambda(x, 1, d - 1, k), abs=1e-9)
        assert (best > float(chi2_mean(x, k * d)) + 1e-9) == beats_u


@pytest.mark.parametrize("k,d,estimator,tight", [(4, 8, "hutch", False), (1, 1, "hutch", False),
                                                 (32, 2048, "hutch", True), (32, 2048, "hutchpp", True)])
def test_discretised_sensitivity_is_stochastically_larger(k, d, estimator, tight):
    """P(A ≥ t) ≥ P(1/√Y ≥ t) = f(1/t²) for every t (conservative), and for k = 32 by no more than one bin (the
    sensitivity overstated by at most 0.25%; small k spread their bins over tens of decades)."""
    a, w, w_inf = rc.sensitivity_law(k, d, estimator)
    assert w.sum() + w_inf == pytest.approx(1, abs=1e-12) and w_inf <= rc.TAIL_MASS * 1.01
    t = np.exp(np.linspace(np.log(0.3), np.log(a.max()), 2000))
    tail = w_inf + np.array([w[a >= ti].sum() for ti in t])
    assert np.all(tail >= envelope_cdf(1 / t ** 2, k, d, estimator) - 1e-12)
    if tight:
        assert np.all(tail <= envelope_cdf(1 / (t / 1.0026) ** 2, k, d, estimator) + 1e-9)


@pytest.mark.parametrize("remove,adjacency", [(True, plm.AdjacencyType.REMOVE), (False, plm.AdjacencyType.ADD)])
def test_mixture_deltas_match_dp_accounting_gaussian(remove, adjacency):
    eps, q = np.linspace(-0.5, 4, 46), 0.05
    for sigma in (0.7, 4.0):
        want = plm.GaussianPrivacyLoss(sigma, 1.0, sampling_prob=q, adjacency_type=adjacency).get_delta_for_epsilon(eps)
        got = rc._mixture_deltas(eps, np.array([1 / sigma]), np.array([1.0]), 0.0, q, remove)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)


def test_degenerate_envelope_gives_the_gaussian_pld_epsilon():
    """Sensitivity 1 with probability 1 is DP-SGD; k = 1e9 squeezes the envelope onto 1."""
    for sigma in (1.0, 4.073):
        want = epsilon_spent(sigma, DELTA_BBC, Q_BBC, STEPS_BBC, "pld")
        one = rc.rc_pld(sigma, Q_BBC, np.array([1.0]), np.array([1.0]), 0.0, PLD_DISCRETIZATION, 1e-12)
        assert one.self_compose(STEPS_BBC).get_epsilon_for_delta(DELTA_BBC) == pytest.approx(want, rel=1e-6)
        got = epsilon_spent(sigma, DELTA_BBC, Q_BBC, STEPS_BBC, "rc", k=10 ** 9, d=2048)
        assert want <= got <= want * 1.001


def test_rc_sigma_decreases_to_dp_sgd_as_k_grows():
    dp_sgd = calibrate_sigma(EPS_BBC, DELTA_BBC, Q_BBC, STEPS_BBC, "pld", tolerance=1e-4)
    sigmas = [calibrate_sigma(EPS_BBC, DELTA_BBC, Q_BBC, STEPS_BBC, "rc", k=k, d=2048, tolerance=1e-4)
              for k in (32, 128, 512, 4096)]
    assert all(a > b for a, b in zip(sigmas, sigmas[1:]))
    assert dp_sgd < sigmas[-1] < 1.01 * dp_sgd


def test_paper_noise_multipliers():
    """DP-SGD-RC Table 4: 4.073 (DP-SGD) and 4.354 (RC, Hutch, k = 32, d = 2048 the Llama-3.2-1B max-min layer size)."""
    dp_sgd = calibrate_sigma(EPS_BBC, DELTA_BBC, Q_BBC, STEPS_BBC, "pld", tolerance=1e-5)
    assert dp_sgd == pytest.approx(4.073, abs=5e-4)
    hutch = calibrate_sigma(EPS_BBC, DELTA_BBC, Q_BBC, STEPS_BBC, "rc", k=32, d=2048, tolerance=1e-4)
    assert hutch == pytest.approx(4.354, rel=0.02)
    assert hutch / dp_sgd == pytest.approx(4.354 / 4.073, rel=0.02)
    # the calibrated sigma spends (just about) the target
    assert 0.99 * EPS_BBC <= epsilon_spent(hutch, DELTA_BBC, Q_BBC, STEPS_BBC, "rc", k=32, d=2048) <= EPS_BBC


def test_invalid_arguments_are_refused():
    call = dict(sigma=1.0, delta=1e-5, sample_rate=0.01, steps=10, accountant="rc")
    for bad in [dict(k=0, d=8), dict(k=2.5, d=8), dict(k=True, d=8), dict(k=32, d=0), dict(k=32, d=None),
                dict(k=32, d=-3)]:
        with pytest.raises(ValueError, match="must be a positive integer"):
            epsilon_spent(**call, **bad)
    with pytest.raises(ValueError, match="allowed hutch, hutchpp"):
        epsilon_spent(**call, d=8, estimator="exact")
    with pytest.raises(ValueError, match="allowed add_remove"):
        epsilon_spent(**call, d=8, neighbouring="replace_one")
    with pytest.raises(ValueError, match="allowed poisson"):
        calibrate_sigma(1.0, 1e-5, 0.01, 10, "rc", sampling="fixed", dataset_size=100, d=8)
    with pytest.raises(ValueError, match="must be a positive integer"):
        envelope_cdf(1.0, 32, 0)
    with pytest.raises(ValueError, match="allowed pld, rdp, rc"):
        epsilon_spent(1.0, 1e-5, 0.01, 10, "prv")


def test_infinite_d_is_the_hutchpp_envelope():
    """d = inf (dpmem's whole-model default) is the d → ∞ limit: Hutch++'s envelope, which bounds every finite d,
    so its ε is the larger."""
    x = np.linspace(0.01, 3, 300)
    want = np.maximum(chi2_mean(x, 32), (x >= 1).astype(float))
    np.testing.assert_allclose(envelope_cdf(x, 32, math.inf), want, rtol=1e-12)
    assert x_plus(32, math.inf) == 1.0
    args = (1.5, DELTA_BBC, Q_BBC, 50)
    inf_hutch = epsilon_spent(*args, "rc", k=32, d=math.inf)
    assert inf_hutch == epsilon_spent(*args, "rc", k=32, d=64, estimator="hutchpp")
    assert inf_hutch > epsilon_spent(*args, "rc", k=32, d=64)


def test_rc_dimension_from_the_model():
    """The DP-SGD-RC paper's d is the max over estimated matrices of min(p, d); the sound whole-model d is inf as soon
    as a second parameter (estimated or exact) can carry the sample's gradient."""
    from torch import nn

    from dpmem.methods.rc import max_layer_dimension, rc_dimension
    alone = nn.Linear(8, 5, bias=False)
    assert rc_dimension(alone) == 5 and rc_dimension(alone, "max_layer") == 5
    assert rc_dimension(nn.Linear(8, 5)) == math.inf  # the bias is normed exactly
    emb = nn.Embedding(50, 12)
    head = nn.Linear(12, 50, bias=False)
    head.weight = emb.weight  # tied: one matrix, counted once
    model = nn.Sequential(emb, nn.Linear(12, 30), nn.Conv2d(3, 40, 3), nn.Conv2d(16, 40, 3, groups=2), head)
    # 50×12 → 12, 30×12 → 12, conv 40 × 3·3·3 → 27; the grouped conv (40 × 8·3·3) is normed exactly
    assert max_layer_dimension(model) == 27 and rc_dimension(model, "max_layer") == 27
    assert rc_dimension(model) == math.inf and rc_dimension(model, 2048) == 2048
    with pytest.raises(ValueError, match="no linear-like weight"):
        max_layer_dimension(nn.LayerNorm(4))


def test_a_batch_of_the_whole_training_set_is_refused_by_the_rc_accountant_in_one_line(tmp_path, cli):
    """At sampling rate 1 the remove side's privacy loss reaches log(1 - q) = -inf, which the rc PLD grid cannot
    start from: refused, where it once ended in a math domain error."""
    r = cli("train", "method=dp-sgd-rc", "data=synthetic", "model=roberta-tiny", "data.seq_len=8", "data.n_train=40",
            "train.batch_size=40", "train.steps=1", "train.device=cpu", f"hydra.run.dir={tmp_path / 'run'}")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and "train.batch_size" in last and "rc accountant needs a rate below 1" in last, r.stderr
