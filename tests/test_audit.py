"""dpmem audit: the one-run bound against closed forms and mechanisms of known epsilon, and proof that it catches
broken privatizers (less noise, no clipping) while every correct method stays below its claimed epsilon."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from scipy import optimize, stats
from torch import nn

from dpmem.audit import run_audit, variants
from dpmem.audit.bound import (audit_bound, correlation_check, epsilon_lower_bound, noise_check, p_value,
                               whole_noise_check)
from dpmem.audit.canaries import BatchCanaries, GradientCanaries
from dpmem.composition import CONF_DIR
from dpmem.config import ConfigError
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.privatize import Privatizer
from dpmem.persample import taps
from dpmem.privacy import calibrate_sigma
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.strategies import make_strategy
from helpers import seeded


def brute_p_value(m, r, v, eps, delta):
    """Steinke et al.'s Theorem 5.2 right-hand side, term by term with exact binomial probabilities."""
    p = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, j) * p**j * (1 - p)**(r - j) for j in range(r + 1)]
    tail = sum(pmf[v:])
    alpha = max((sum(pmf[v - i:v]) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, tail + 2 * m * delta * alpha)


@pytest.mark.parametrize("m,r,v,eps,delta", [(10, 6, 5, 0.5, 0.0), (40, 20, 17, 1.0, 1e-3), (100, 30, 30, 3.0, 1e-5),
                                             (50, 10, 0, 2.0, 1e-2)])
def test_p_value_is_the_theorems_right_hand_side(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(brute_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


def test_the_bound_is_the_largest_epsilon_ruled_out():
    eps = epsilon_lower_bound(200, 100, 90, 0.05, 1e-5)
    assert p_value(200, 100, 90, eps, 1e-5) < 0.05 <= p_value(200, 100, 90, eps + 1e-6, 1e-5)
    assert epsilon_lower_bound(200, 100, 50, 0.05, 1e-5) == 0.0  # chance level rules nothing out


def test_the_p_value_is_theorem_5_2s_with_every_term_of_its_delta_sum():
    """p_value stops its sum over i = 1..v once no later term can pass the largest: the same value as every term's
    (Steinke et al.'s Theorem 5.2, written out here), on random canary counts up to 200,000."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        m = int(rng.integers(2, 200_000))
        r = int(rng.integers(1, m + 1))
        v, epsilon, delta = int(rng.integers(0, r + 1)), float(rng.uniform(0, 8)), float(10 ** rng.uniform(-10, -1))
        q = math.exp(epsilon) / (1 + math.exp(epsilon))
        want = float(stats.binom.sf(v - 1, r, q))
        if v:
            below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)
            want += 2 * m * delta * float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
        assert p_value(m, r, v, epsilon, delta) == pytest.approx(min(want, 1.0), rel=1e-12, abs=1e-300), (m, r, v)


def gaussian_epsilon(sigma: float, delta: float) -> float:
    """The exact epsilon of the Gaussian mechanism of sensitivity 1 (Balle and Wang 2018, Theorem 8)."""
    def gap(eps):
        return (stats.norm.cdf(-eps * sigma + 1 / (2 * sigma))
                - math.exp(eps) * stats.norm.cdf(-eps * sigma - 1 / (2 * sigma)) - delta)
    return optimize.brentq(gap, 0, 100)


def gaussian_audit(sigma, delta, m, seed):
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    return audit_bound(included + sigma * rng.standard_normal(m), included, delta=delta)["epsilon_lower_bound"]


@pytest.mark.long
def test_on_a_bare_gaussian_mechanism_the_bound_grows_towards_its_epsilon_and_never_passes_it():
    sigma, delta = 2.0, 1e-6
    true = gaussian_epsilon(sigma, delta)  # 2.25
    by_m = [np.mean([gaussian_audit(sigma, delta, m, seed) for seed in range(3)]) for m in (100, 1000, 10000, 100000)]
    assert by_m == sorted(by_m) and by_m[0] < 0.2 * true and by_m[-1] > 0.45 * true
    assert all(gaussian_audit(sigma, delta, 1000, seed) < true for seed in range(20))


def test_on_randomized_response_the_bound_is_nearly_tight_and_never_passes_it():
    """Pure eps-DP randomized response is the null's extreme case: the bound approaches eps with m. It passes eps
    with probability at most beta = 5 % a run (seeds pinned: here once in ten, by 0.2 %)."""
    eps, bounds = 1.0, []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        included = rng.random(20000) < 0.5
        truthful = rng.random(20000) < math.exp(eps) / (1 + math.exp(eps))
        bounds.append(audit_bound(np.where(truthful, included, ~included).astype(float), included, delta=0.0,
                                  ks=[10000])["epsilon_lower_bound"])
    assert all(0.9 * eps < b < 1.01 * eps for b in bounds) and sum(b > eps for b in bounds) <= 1


# -- the real Privatizer, with a linear model whose inputs use 16 of 256 features (canaries on the unused weights)
class SharedOverPositions(nn.Module):
    def __init__(self, features=256, classes=10):
        super().__init__()
        self.linear = nn.Linear(features, classes)

    def forward(self, x):  # (B, K, features): K uses of one weight, as a tied embedding and head are two
        return sum(self.linear(x[:, k]) for k in range(x.shape[1]))


def privatizer_audit(clipping="materialize", eps=2.0, m=1000, n=512, batch=256, steps=20, delta=1e-5, seed=0,
                     plant="sum", chunks=1, positions=0, uses=16, hidden=0, mechanism_of=None, noise=None, bands=4):
    """The bound and the noise checks of `m` gradient canaries planted in the clipped sum (plant="sum") or joining
    the micro-batches (plant="batch"), over `steps` Poisson-sampled steps split into `chunks` micro-batches each;
    `positions` > 0 uses the linear layer that many times per sample; `hidden` > 0 puts a hidden layer of that
    width before it; `mechanism_of` makes a broken mechanism of the calibrated one (`dpmem.audit.variants`);
    `noise` (bandmf, bisr) correlates the noise with that strategy of `bands` bands made for the `steps`."""
    torch.manual_seed(seed)
    q = batch / n
    sigma = calibrate_sigma(eps, delta, q, steps)
    model = (SharedOverPositions() if positions else
             nn.Sequential(nn.Linear(256, hidden), nn.Tanh(), nn.Linear(hidden, 10)) if hidden else nn.Linear(256, 10))
    x = torch.zeros(n, 256) if not positions else torch.zeros(n, positions, 256)
    x[..., :16] = torch.randn(*x.shape[:-1], 16)
    y = torch.randint(0, 10, (n,))

    def loss_fn(model, b):
        return nn.functional.cross_entropy(model(b["x"]), b["y"], reduction="none")
    gen = torch.Generator().manual_seed(seed)
    canaries = (GradientCanaries(m, norm=10.0, seed=seed) if plant == "sum"
                else BatchCanaries(m, norm=10.0, seed=seed, uses=uses))
    noise = GaussianMechanism(sigma, 1.0, q * n, seeded(seed), sample_rate=q, observers=(canaries,),
                              plan=ClippingPlan.of(clipping),
                              strategy=make_strategy(noise, bands, steps) if noise else None)
    if mechanism_of is not None:
        noise = mechanism_of(noise, model, canaries)
    with Privatizer(model, noise, noise.plan) as privatizer:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            idx = (torch.rand(n, generator=gen) < q).nonzero().flatten()
            micro = [{"x": x[part], "y": y[part]} for part in idx.tensor_split(chunks)]
            grads, _ = privatizer.gradient(micro, loss_fn, {p: p.shape for p in privatizer.params})
            for p in privatizer.params:
                p.grad = grads[p]
            optimizer.step()
    bound = audit_bound(canaries.scores.numpy(), canaries.included.numpy(), delta=delta,
                        groups=canaries.groups().numpy())
    names = {p: name for name, p in model.named_parameters()}
    return {**bound, **noise_check(canaries.noise_squares, canaries.noise_count, canaries.sigma),
            **whole_noise_check(canaries.step_squares, canaries.tensor_sizes, canaries.sigma,
                                [names[p] for p in canaries.tensor_keys], differences=canaries.step_differences),
            **correlation_check(canaries.noise_cosines, canaries.noise_dim),
            "untouched": canaries.untouched}  # the canaries sat where the first step's sum was 0: no real gradient


def lower_bound(**kwargs) -> float:
    return privatizer_audit(**kwargs)["epsilon_lower_bound"]


@pytest.mark.parametrize("clipping", ["materialize", "fgc", "ghost", "mixed", "hutch"])
def test_a_correct_privatizer_audits_below_its_claimed_epsilon(clipping):
    assert 0 < lower_bound(clipping=clipping) < 2.0


@pytest.mark.parametrize("clipping", ["materialize", "bk", "ghost", "hutch"])
def test_a_correct_privatizer_audits_below_its_claimed_epsilon_with_canaries_in_the_batch(clipping):
    """Canaries made by the layer's own hooks, 16 calls each, over 4 micro-batches: the noise check sees the noise
    claimed (the left-out canaries' coordinates hold nothing else), and the bound stays below ε."""
    record = privatizer_audit(clipping=clipping, plant="batch", chunks=4)
    assert 0 < record["epsilon_lower_bound"] < 2.0
    assert not record["noise_flagged"] and record["noise_ratio"] == pytest.approx(1.0, abs=0.03)


def test_noise_scaled_down_by_root_b_is_caught():
    assert lower_bound(mechanism_of=variants.noise_divided_by(math.sqrt(256))) > 2.0


class NoClipping(variants.BrokenMechanism):
    """A mechanism whose clip factors are all 1."""

    def clip_factors(self, squares):
        return torch.ones_like(next(iter(squares.values())))


def test_no_clipping_is_caught():
    assert lower_bound(mechanism_of=lambda mechanism, model, canaries: NoClipping(mechanism)) > 2.0


@pytest.mark.parametrize("clipping", ["materialize", "ghost", "hutch"])
def test_per_sample_norms_that_never_clip_real_samples_are_caught(clipping):
    """Issue 34: the canaries' norms come from the norm rule the real samples' do (one pass or the first of two),
    so a rule that returns 0 for every sample, which leaves every real gradient unclipped, leaves them unclipped
    too: the audit sees 10 C where C was claimed."""
    assert lower_bound(clipping=clipping) < 2.0
    assert lower_bound(clipping=clipping, mechanism_of=variants.norms_by(lambda g: torch.zeros(g.shape[0]))) > 2.0


# -- issue 42's three variants that canaries planted in the clipped sum miss
@pytest.mark.parametrize("clipping", ["materialize", "bk", "ghost"])
def test_clipping_skipped_for_real_samples_only_is_caught_by_canaries_in_the_batch(clipping):
    """(a) The step's micro-batches unclipped (clip factors of 1); the planted canaries, clipped after them by the
    Privatizer's `clipped_sum_of`, clipped."""
    skip = variants.skip_real_clipping()
    assert lower_bound(clipping=clipping, mechanism_of=skip) < 2.0  # the planted canaries audit it correct
    assert lower_bound(clipping=clipping, plant="batch", chunks=2, mechanism_of=skip) > 2.0  # the batch's are not


def test_noise_per_microbatch_is_caught_by_the_noise_check():
    """k = 4 micro-batches (the issue's case: true ε about 4.7 for a claimed 2) is beyond the one-run bound's power
    at m = 1000 (a bare Gaussian mechanism of that ε audits below 2 too), not beyond the noise check's: the
    released values where no canary is vary by σ/√5, not σ (the canaries' own micro-batch is a fifth)."""
    assert not privatizer_audit(plant="batch", chunks=4, uses=1)["noise_flagged"]
    # a canary's uses do not matter to the noise
    record = privatizer_audit(plant="batch", chunks=4, uses=1, mechanism_of=variants.noise_per_microbatch())
    assert record["noise_flagged"] and record["noise_ratio"] == pytest.approx(5 ** -0.5, abs=0.03)
    assert record["epsilon_lower_bound"] < 2.0  # what the bound alone says: not caught at this k


def test_noise_per_microbatch_over_many_microbatches_is_caught_by_the_bound():
    """k = 32 micro-batches: noise σ/√32 in all; the bound alone passes the claimed ε (at k = 16 it reaches 1.8 to
    2.2 over seeds: the smallest break of this kind that m = 1000 canaries show is about there)."""
    assert lower_bound(plant="batch", chunks=32, uses=1, mechanism_of=variants.noise_per_microbatch()) > 2.0


def test_norms_per_use_are_caught_by_canaries_in_the_batch():
    """The issue's weight shared 16 times (by the real samples too). Each batch canary is 16 uses of its weight:
    normed per use, it passes 4 C where C was claimed. Planted in the sum it is one use, and audits as correct."""
    assert lower_bound(clipping="ghost", plant="batch", positions=16) < 2.0
    per_use = variants.norms_per_use()
    assert lower_bound(clipping="ghost", positions=16, mechanism_of=per_use) < 2.0
    assert lower_bound(clipping="ghost", plant="batch", positions=16, mechanism_of=per_use) > 2.0


# -- input canaries through a weight used K times (one shared Linear over K positions), two-pass clipping

def tied_audit(eps=2.0, m=1000, n=512, positions=16, steps=20, delta=1e-5, sampling="poisson", seed=0,
               check_coverage=True):
    """Canary i: all K positions hold a·e_j (j an input feature no real example uses) with label c. Each use's
    per-sample gradient is the same column, so the summed gradient's norm is K times a use's: clipped on the sum
    it has norm C, clipped per use √K·C. Score: minus the released gradient at (c, j), summed over steps."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    real = torch.zeros(n, positions, 256)
    real[:, :, :16] = torch.randn(n, positions, 16, generator=gen)
    label = torch.arange(m) % 10
    where = 16 + (torch.arange(m) // 10) % 240  # (label, feature) pairs are distinct up to m = 2400
    canary_x = torch.zeros(m, positions, 256)
    canary_x[torch.arange(m), :, where] = 100.0
    included = torch.rand(m, generator=gen) < 0.5
    x = torch.cat([real, canary_x[included]])
    y = torch.cat([torch.randint(0, 10, (n,), generator=gen), label[included]])
    total, q = len(x), 0.5
    sigma = calibrate_sigma(eps, delta, q, steps)
    model = SharedOverPositions()
    nn.init.zeros_(model.linear.weight)  # uniform predictions: every canary's gradient is (1/10 - e_c)·a, far above C
    nn.init.zeros_(model.linear.bias)

    def loss_fn(model, b):
        return nn.functional.cross_entropy(model(b["x"]), b["y"], reduction="none")
    scores = torch.zeros(m, dtype=torch.float64)
    order = torch.randperm(total, generator=gen)
    # the model stays where it is: a canary the model had learnt would have a small gradient and score little
    with Privatizer(model, GaussianMechanism(sigma, 1.0, q * total, seeded(seed)), ClippingPlan.of("ghost"),
                    check_coverage) as privatizer:
        for t in range(steps):
            if sampling == "poisson":
                idx = (torch.rand(total, generator=gen) < q).nonzero().flatten()
            else:  # shuffled batches of size q·n, every example once per epoch
                half = total // 2
                idx = order[(t % 2) * half:(t % 2 + 1) * half]
            grads, _ = privatizer.gradient([{"x": x[idx], "y": y[idx]}], loss_fn,
                                           {p: p.shape for p in privatizer.params})
            scores -= grads[model.linear.weight][label, where].double()
    return audit_bound(scores.numpy(), included.numpy(), delta=delta)["epsilon_lower_bound"]


def test_a_weight_used_many_times_clipped_on_its_sum_audits_below_its_claimed_epsilon():
    assert tied_audit() < 2.0


def test_a_weight_used_many_times_clipped_per_use_is_caught(monkeypatch):
    # every use is reduced as if it were the only one: the weight is normed on its first use's gradient alone
    monkeypatch.setattr(taps, "tied_sum", lambda earlier, later: later)
    with pytest.raises(RuntimeError, match="are not each sample.s own"):
        tied_audit()  # the first step's attribution proof sees this bug already
    assert tied_audit(check_coverage=False) > 2.0  # and the audit sees it without that check


def test_shuffled_batches_under_the_poisson_accountant_are_not_caught_at_this_scale():
    """Not a proof of safety: the amplification that shuffling lacks is too small a difference for m = 1000."""
    assert tied_audit(sampling="shuffle") < 2.0


# -- dpmem audit end to end, on a tiny ViT and digits (q ≈ 0.49)
TINY = ["model.arch.hidden_size=8", "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2",
        "model.arch.intermediate_size=16", "model.arch.patch_size=4"]


RANK = {m: ["method.rank=4"] for m in ("grape", "galore-dp-naive")}  # below the tiny ViT's width 8: they project


def config(*overrides, model=TINY):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        # the noise and the batches are pinned: an audit's bound is a random variable, and a test must not be one
        return compose("config", overrides=["logging.progress=false", "logging.memory_steps=0", "privacy=eps2",
                                            "privacy.noise_seed=1", "privacy.sampler_seed=1", "train.steps=10",
                                            "train.batch_size=700", "audit.canaries=500", *model, *overrides])


@pytest.mark.parametrize("method", ["dp-adam", "grape", "galore-dp-naive", "dp-sgd-rc", "dpzero"])
def test_every_private_method_audits_below_its_claimed_epsilon(tmp_path, method):
    record, text = run_audit(config(f"method={method}", *RANK.get(method, [])), tmp_path)
    assert record["epsilon_lower_bound"] < record["epsilon_claimed"] <= 2.0 and not record["flagged"]
    assert record["plant"] == ("sum" if method in ("grape", "dpzero") else "batch")  # audit.plant=auto
    assert record["noise_ratio"] == pytest.approx(1.0, abs=0.5 if method == "dpzero" else 0.1)  # dpzero: 10 steps
    assert record["canaries"] == 500 and record["guesses"] <= 500 and f"| {method} |" in text
    assert {"audit.json", "audit.md", "scores.png", "scores.pdf"} <= {p.name for p in tmp_path.iterdir()}


def test_dpmem_audit_catches_a_method_that_does_not_clip(tmp_path):
    record, _ = run_audit(config("method=dp-adam", "audit.norm=100"), tmp_path,
                          mechanism_of=lambda mechanism, model, canaries: NoClipping(mechanism))
    assert record["epsilon_lower_bound"] > record["epsilon_claimed"]


def test_input_canaries_are_mislabelled_examples_in_the_training_set(tmp_path):
    record, _ = run_audit(config("method=grape", *RANK["grape"], "audit.kind=input", "audit.canaries=200"), tmp_path)
    summary_n = 1437 - 200 + record["included"]  # the canaries left out are out of the training set
    assert record["kind"] == "input" and len(record["scores"]) == 200
    assert record["epsilon_lower_bound"] < record["epsilon_claimed"]
    assert all(s <= 0 for s in record["scores"])  # minus a cross-entropy
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["n_train"] == summary_n


def test_dpmem_audit_sees_a_tied_weight_normed_per_use_on_roberta_mlm(tmp_path):
    """Issue 42 (c) end to end: RoBERTa's word embeddings are its MLM head's weight (two uses a sample). Batch canaries
    are 16 uses of their weight (a tied one's owners in turn): normed per use, they pass up to 4 C. Spread over every
    weight, the tied one most (it is the largest), with the real gradients' background out of their scores, they
    move the bound from 0.30 to 1.36 in these 10 steps, and past the claim over the 240 steps of
    scripts/audit_variants.py's RoBERTa rows (about 2 at m = 1000; its page). Seeds pinned: deterministic."""
    roberta = ["model=roberta-tiny", "model.head=mlm", "data=synthetic", "data.seq_len=16", "train.batch_size=512",
               "audit.canaries=1000", "method=dp-adam"]
    correct, _ = run_audit(config(model=roberta), tmp_path / "correct")
    tied = "roberta.embeddings.word_embeddings.weight = lm_head.decoder.weight"
    assert len(correct["canaries_in"]) == 16 and max(correct["canaries_in"].values()) == correct["canaries_in"][tied]
    assert correct["epsilon_lower_bound"] < correct["epsilon_claimed"] and not correct["flagged"]
    broken, _ = run_audit(config(model=roberta), tmp_path / "broken", mechanism_of=variants.norms_per_use())
    assert broken["clipping"] == "bk" and broken["epsilon_lower_bound"] > correct["epsilon_lower_bound"] + 0.8


@pytest.mark.parametrize("overrides,key", [(["method=adam"], "method.name"), (["privacy=none"], "privacy"),
                                           (["audit.beta=1.5"], "audit.beta"), (["audit.canaries=1"], "audit.canaries"),
                                           (["train.checkpoint_every=2"], "train.checkpoint_every"),
                                           (["method=grape", "audit.plant=batch"], "audit.plant"),
                                           (["audit.uses=0"], "audit.uses")])
def test_what_cannot_be_audited_is_refused(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        run_audit(config(*overrides), tmp_path)


def test_dpmem_audit_cli_writes_one_table_for_a_sweep(tmp_path, cli):
    r = cli("audit", "method=dp-adam,dpzero", *TINY, "logging.progress=false", "logging.memory_steps=0",
            "privacy=eps2", "train.steps=3", "train.batch_size=700", "audit.canaries=50", "hydra.run.dir=a")
    assert r.returncode == 0, r.stderr  # hydra.run.dir names the folder, as for dpmem train (audit.dir too)
    assert (Path(tmp_path) / "a" / "audit.md").read_text() == r.stdout
    assert "| dp-adam |" in r.stdout and "| dpzero |" in r.stdout
    assert {p.name for p in (tmp_path / "a").iterdir()} == {".dpmem", "audit.md", "method=dp-adam", "method=dpzero"}


def test_the_whole_model_noise_check_passes_a_correct_run_and_catches_a_tensor_or_a_step_with_too_little_noise():
    """Noise at σ/2 on the tensor no canary lives in (the bias: batch canaries live in weights; true ε about 4.5
    where 2 is claimed), and the noise skipped on one step of 60: the canaries' own check and bound see neither; the
    check over every coordinate and every step sees both. Seeds pinned: each outcome is a random variable."""
    correct = privatizer_audit(steps=60, plant="batch", uses=1)
    assert not correct["whole_noise_flagged"] and correct["worst_tensor_ratio"] > 0.95
    cut = privatizer_audit(steps=60, plant="batch", uses=1, mechanism_of=variants.noise_cut_away_from())
    assert not cut["noise_flagged"] and cut["epsilon_lower_bound"] < 2.0  # the canaries' weight is noised as claimed
    assert cut["whole_noise_flagged"] and cut["worst_tensor"] == "bias"
    assert cut["worst_tensor_ratio"] == pytest.approx(0.5, abs=0.05)
    skipped = privatizer_audit(steps=60, mechanism_of=variants.noise_skipped_on(37))
    assert not skipped["noise_flagged"] and skipped["epsilon_lower_bound"] < 2.0
    assert skipped["whole_noise_flagged"] and skipped["worst_step"] == 37 and skipped["worst_step_ratio"] < 0.2


@pytest.mark.parametrize("plant", ["sum", "batch"])
def test_clip_factors_from_one_layer_are_caught_by_canaries_spread_over_the_model(plant):
    """Clip factors from the second layer's norm alone: the first layer's gradients go through unclipped (true ε
    ∞). Canaries are spread over every weight, so those in the first layer pass 10 C where C was claimed."""
    assert lower_bound(hidden=64, plant=plant, uses=1) < 2.0
    record = privatizer_audit(hidden=64, plant=plant, uses=1, mechanism_of=variants.clipping_from("2.weight"))
    assert record["epsilon_lower_bound"] > 2.0


def test_dpzero_with_a_quarter_of_its_noise_is_caught_by_its_noise_check(tmp_path):
    """DPZero's noise check sees what the release added to the clipped sum it was handed, step by step: a quarter
    of the noise (true ε about 11 where 2 is claimed) is flagged, the correct run is not
    (test_every_private_method_audits_below_its_claimed_epsilon)."""
    record, _ = run_audit(config("method=dpzero"), tmp_path, mechanism_of=variants.noise_divided_by(4))
    assert record["noise_flagged"] and record["flagged"]
    assert record["noise_ratio"] < 0.5  # 0.25 over 10 steps: a χ² of 10 degrees of freedom


@pytest.mark.parametrize("method", ["dp-adam", "grape", "dpzero"])
def test_more_canaries_than_coordinates_are_refused_before_training_and_as_many_fit(tmp_path, method):
    """audit.canaries=100000 was refused by the first step's placing, after the whole run had trained: now
    `check_room` (which dpmem audit asks before any point trains) counts the coordinates on the run's parts built
    without weights, and the count is exact (as many canaries run)."""
    from dpmem.audit import check_room
    with pytest.raises(ConfigError, match=r"audit\.canaries: 100000 canaries need a coordinate each; .* has (\d+) "
                       r"in ") as refused:
        check_room(config(f"method={method}", "audit.canaries=100000", *RANK.get(method, [])))
    room = int(str(refused.value).split(" has ")[1].split()[0])
    record, _ = run_audit(config(f"method={method}", f"audit.canaries={room}", "train.steps=2",
                                 *RANK.get(method, [])), tmp_path / "full")
    assert record["canaries"] == room


# -- issue 65: the noise checks follow the claimed noise's correlation across steps
def fresh_cosines(rng, steps, dim, lags, rho=0.0):
    """The canaries' cosines (`GradientCanaries.noise_cosines`) of `steps` noise vectors of `dim` values, each
    rho times the last plus fresh standard normal noise (rho = 0: the claim)."""
    z = rng.standard_normal((steps, dim))
    for t in range(1, steps):
        z[t] += rho * z[t - 1]
    unit = z / np.linalg.norm(z, axis=1, keepdims=True)
    return [[float(unit[t] @ unit[t - lag]) for lag in range(1, min(t, lags) + 1)] for t in range(steps)]


def test_the_correlation_check_is_exact_under_fresh_noise_and_sees_a_small_correlation():
    """Under the claim each pair's cosine has the exact law of a sample correlation (Student's t of dim − 1
    degrees of freedom), so at 2 values a step (a Cauchy t, where a normal approximation is far off) the lag's
    p-value is uniform, and the worst pair's is the least of T − 1 independent uniforms: both checked by a
    Kolmogorov–Smirnov test over 1000 seeded runs (it rejects the normal approximation's p-values at any of
    these sizes). A correlation of 0.1 on every step is flagged at 500 values over 20 steps (the pooled score
    about 0.1·√(500·19) ≈ 10 where 5.2 flags, 10⁻⁶ over 4 lags); one step repeating the last is flagged alone."""
    rng, steps = np.random.default_rng(0), 12
    records = [correlation_check(fresh_cosines(rng, steps, 2, 1), 2) for _ in range(1000)]
    assert not any(r["correlation_flagged"] for r in records)
    assert stats.kstest([r["worst_lag_p_value"] for r in records], "uniform").pvalue > 1e-3
    least = [1 - (1 - r["worst_pair_p_value"]) ** (steps - 1) for r in records]  # P[min of T − 1 uniforms ≤ p]
    assert stats.kstest(least, "uniform").pvalue > 1e-3
    correlated = correlation_check(fresh_cosines(rng, 20, 500, 4, rho=0.1), 500)
    assert correlated["correlation_flagged"] and correlated["worst_lag"] == 1
    assert correlated["worst_lag_correlation"] == pytest.approx(0.1, abs=0.03)
    repeated = fresh_cosines(rng, 20, 500, 4)
    repeated[9][0] = 1.0  # step 9's noise is step 8's
    record = correlation_check(repeated, 500)
    assert record["correlation_flagged"] and record["worst_pair"] == [8, 9] and record["worst_pair_p_value"] == 0
    assert not correlation_check(fresh_cosines(rng, 20, 500, 4), 500)["correlation_flagged"]


@pytest.mark.parametrize("name", ["bandmf", "bisr"])
def test_whitening_by_the_claimed_strategy_gives_back_its_draws_across_restarts(name):
    """C times the strategy's noise C⁻¹z, coordinate by coordinate over 12 releases whose correlation restarts
    every 5 steps (a projected method's refresh), is the keyed draws z, which an independent strategy of the same
    key draws; without the restart it is not, after one."""
    from dpmem.audit.canaries import Whitening
    from dpmem.privacy.correlated import CorrelatedNoise
    strategy, key = make_strategy(name, 4, 5), seeded(0).key
    fresh, correlated = (CorrelatedNoise(s, key, 5) for s in (make_strategy("independent", 1, 5), strategy))
    whitening, unrestarted = Whitening(strategy, 5), Whitening(strategy, None)
    gaps = []
    for _ in range(12):
        z, w = (noise.noise("0", (7,), "cpu", torch.float64) for noise in (fresh, correlated))
        assert torch.allclose(whitening({"x": w})["x"], z, atol=1e-12)
        gaps.append(float((unrestarted({"x": w})["x"] - z).abs().max()))
        fresh.advance()
        correlated.advance()
    # the same until the first restart (release 4), then not while the last block's noise is in reach (b − 1 steps)
    assert max(gaps[:4]) < 1e-12 < min(gaps[4:7])
    assert Whitening(None, None)({"x": z})["x"] is z  # independent noise is its own draws


@pytest.mark.parametrize("plant,step", [("sum", 7), ("batch", 0)])
def test_noise_reused_on_two_consecutive_steps_is_caught_by_the_noise_checks(plant, step):
    """The same noise on steps `step` and `step + 1` (true ε ∞: their difference is noise-free) audited 0.17,
    unflagged: each step's noise has the claimed scale, and the bound cannot see one step pair. The left-out
    canaries' noise of the two steps has cosine 1 (p = 0, exact), and the whole model's difference of the two
    releases holds no noise, only the clipped sums' change. Batch canaries record the first step's noise too."""
    record = privatizer_audit(plant=plant, uses=1, mechanism_of=variants.noise_reused_on(step))
    assert record["epsilon_lower_bound"] < 2.0 and not record["noise_flagged"]
    assert record["correlation_flagged"] and record["worst_pair"] == [step, step + 1]
    assert record["worst_pair_correlation"] == pytest.approx(1.0) and record["worst_pair_p_value"] == 0
    assert record["whole_noise_flagged"] and record["worst_difference"] == step + 1
    assert record["worst_difference_ratio"] < 0.2  # about √2 on every other pair
    assert record["worst_tensor_ratio"] > 0.9 and record["worst_step_ratio"] > 0.9


def test_correlated_noise_is_checked_after_un_correlating_and_broken_strategies_are_caught():
    """bandmf and bisr (4 bands over 20 steps) noise a release by σ(C⁻¹z)_i, which varies by σ²Σ_j (C⁻¹)²_ij, more
    than σ² (hiding a cut below it): the checks multiply by the claimed C first, so both read 1.00 and, from one
    noise key, see the same draws z. No correct strategy is flagged (each family at 10⁻⁶, seeds pinned). bandmf
    with its buffers dropped (z/c_0 each step: lag-1 correlation about 0.6 after C) and with its last band's
    coefficient halved (lag 3, about 0.17) are flagged by the correlation check: over 508 left-out canaries and 19
    or 17 step pairs their pooled scores are 63 and 16 where 5.2 flags (10⁻⁶ over 4 lags, two-sided), so its power
    is about 1; their scale is not below the claim."""
    correct = {noise: privatizer_audit(noise=noise) for noise in (None, "bandmf", "bisr")}
    for record in correct.values():
        assert not (record["noise_flagged"] or record["whole_noise_flagged"] or record["correlation_flagged"])
        assert record["noise_ratio"] == pytest.approx(1.0, abs=0.03) and record["worst_lag_p_value"] > 1e-3
    # the same z but for the float32 releases' rounding
    assert correct["bandmf"]["noise_ratio"] == pytest.approx(correct["bisr"]["noise_ratio"], rel=1e-6)
    assert correct["bandmf"]["worst_lag"] == 4  # up to b lags tested
    dropped = privatizer_audit(noise="bandmf", mechanism_of=variants.buffers_dropped())
    halved = privatizer_audit(noise="bandmf", mechanism_of=variants.band_halved(3))
    assert dropped["correlation_flagged"] and dropped["worst_lag"] == 1 and dropped["worst_lag_correlation"] > 0.4
    assert halved["correlation_flagged"] and halved["worst_lag"] == 3 and halved["worst_lag_correlation"] > 0.1
    assert not (dropped["noise_flagged"] or halved["noise_flagged"])


CYCLIC = ["train.sampling=cyclic", "privacy.bands=4", "train.batch_size=300", "train.steps=20"]


@pytest.mark.parametrize("overrides", [["method=dp-adam", "privacy.noise=bandmf"],
                                       ["method=grape", *RANK["grape"], "method.refresh=6", "privacy.noise=bisr"],
                                       ["method=dpzero", "privacy.noise=bandmf"]])
def test_dpmem_audit_follows_the_claimed_correlated_noise(tmp_path, overrides):
    """Through `dpmem audit` (canaries in the batch, in grape's projection, in DPZero's scalar): the run's
    strategy, restarting at grape's refresh, is what its noise checks un-correlate by, so a correct run reads the
    claimed noise and is not flagged; the record names the strategy."""
    record, text = run_audit(config(*overrides, *CYCLIC), tmp_path)
    assert not record["flagged"] and record["strategy"] in text and record["bands"] == 4
    dpzero = "method=dpzero" in overrides
    assert record["noise_ratio"] == pytest.approx(1.0, abs=0.5 if dpzero else 0.1)  # dpzero: 20 values
    assert (record["worst_lag"] is None) == dpzero  # one scalar a step has no direction to correlate


def test_dpmem_audit_flags_noise_reused_on_two_steps(tmp_path):
    """The blind spot end to end (it audited 0.17, unflagged): flagged, and the table names the pair. The run's
    memory meter counts what the swapped noise keeps (it asks `correlated` for its tensors)."""
    record, text = run_audit(config("method=dp-adam", "logging.memory_steps=2"), tmp_path,
                             mechanism_of=variants.noise_reused_on(4))
    assert record["flagged"] and record["correlation_flagged"] and record["worst_pair"] == [4, 5]
    assert "steps 4–5: 1.00 (0) flagged" in text


def test_canaries_are_sampled_as_records_are_under_cyclic_sampling():
    """Correlated noise's records join only their cyclic group's steps, at the group's rate: so do the canaries,
    else the bound would rate a participation the accountant does not assume (each step at q)."""
    from types import SimpleNamespace

    from dpmem.audit.canaries import GradientCanaries
    canaries = GradientCanaries(400, 1.0, seed=3)
    mechanism = SimpleNamespace(groups=4, sample_rate=0.05, event=SimpleNamespace(dataset_size=1000), releases=0)
    joined = torch.zeros(400, 4)
    for t in range(400):
        mechanism.releases = t
        joined[:, t % 4] += canaries.sample(mechanism).float()
    assert not joined[~canaries.included].any()
    own = joined.gather(1, canaries.group.view(-1, 1)).squeeze(1)
    assert joined.sum() == own.sum()  # never on another group's step
    rate = own[canaries.included].mean() / 100  # 100 turns each; the group rate is 50 / floor(1000 / 4) = 0.2
    assert abs(float(rate) - 0.2) < 0.02
