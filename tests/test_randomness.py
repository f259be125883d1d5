"""Secret randomness (dpmem.privacy.randomness): every bit of a key or seed changes the draws, and the draws keep
their laws (χ² for the Poisson sampler, Kolmogorov–Smirnov for the noise)."""

import numpy as np
import pytest
import torch
from scipy import stats

from dpmem.engine.trainer import Run
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, Drawn, derive, seed_key
from dpmem.privacy.sampling import poisson_batches
from helpers import config


def batches(key: bytes, n=200, q=0.1, steps=5) -> list[list[int]]:
    return [b.tolist() for b in poisson_batches(n, q, steps, Draws(key, "batches"))]


def noise(key: bytes, device="cpu", n=50) -> torch.Tensor:
    summed = {0: torch.zeros(n, device=device)}
    return GaussianMechanism(1.0, 1.0, 1.0, Draws(key, "noise", device)).release(summed)[0]


def os_like_keys() -> tuple[bytes, bytes]:
    """Two keys equal in their low 64 bits (and the next 64), different only in the top byte."""
    a = bytes(range(32))
    return a, a[:31] + bytes([a[31] ^ 1])


@pytest.mark.parametrize("high", [32, 64, 100])
def test_seeds_that_differ_only_above_bit_k_give_other_batches_and_noise(high):
    """torch's CPU generator keeps the low 32 bits of a seed (5 and 5 + 2³² give one stream): dpmem's keys don't."""
    a, b = seed_key(5), seed_key(5 + 2**high)
    assert batches(a) != batches(b)
    assert not torch.equal(noise(a), noise(b))
    assert batches(a) == batches(seed_key(5)) and torch.equal(noise(a), noise(seed_key(5)))  # and a seed replays


def test_keys_that_differ_only_above_bit_64_give_other_batches_and_noise():
    a, b = os_like_keys()
    assert batches(a) != batches(b)
    assert not torch.equal(noise(a), noise(b))


def test_a_run_takes_its_seeds_whole(tmp_path):
    """privacy.sampler_seed and privacy.noise_seed feed the run's draws in full: 5 and 5 + 2³² are other runs."""
    def prepared(seed):
        run = Run(config("method=dp-adam", f"privacy.sampler_seed={seed}", f"privacy.noise_seed={seed}",
                         "train.device=cpu"), tmp_path)
        run.prepare()
        return [b.tolist() for b in run.batches()], run.method.mechanism.state.noise.randn(20)

    (b1, z1), (b2, z2), (b3, z3) = prepared(5), prepared(5 + 2**32), prepared(5)
    assert b1 != b2 and not torch.equal(z1, z2)
    assert b1 == b3 and torch.equal(z1, z3)


def test_an_accounted_run_without_seeds_draws_its_keys_from_the_os(tmp_path):
    runs = [Run(config("method=dp-adam", "train.device=cpu"), tmp_path) for _ in range(2)]
    for run in runs:
        run.prepare()
    first, second = (run.mechanism.sampler.key for run in runs)
    assert first != second and len(first) * 8 >= 128
    assert runs[0].method.mechanism.state.noise.key != runs[1].method.mechanism.state.noise.key


def test_draws_are_keyed_by_purpose_and_count_alone():
    key = seed_key(1)
    first = Draws(key, "noise")
    a, b = first.randn(8), first.randn(8)
    assert not torch.equal(a, b)
    again = Draws(key, "noise", count=1)
    assert torch.equal(again.randn(8), b)  # draw 1 without draw 0
    assert not torch.equal(Draws(key, "probes").randn(8), a)
    assert derive(key, "noise", 0) != derive(key, "noise", 1) != derive(seed_key(2), "noise", 1)
    restored = Draws(seed_key(9), "x")
    restored.load_state_dict(first.state_dict())
    assert torch.equal(restored.randn(8), Draws(key, "noise", count=2).randn(8))
    with pytest.raises(ValueError, match="128"):
        Draws(b"short", "noise")


def test_the_poisson_sampler_keeps_its_law():
    """Each record joins each step with probability q, independently: a record's count over S steps is
    Binomial(S, q) (χ² over the records' counts), and a batch's size is Binomial(n, q) (χ² over the steps')."""
    n, q, steps = 1000, 0.1, 400
    drawn = list(poisson_batches(n, q, steps, Draws(seed_key(3), "batches")))
    counts = np.bincount(torch.cat(drawn).numpy(), minlength=n)
    sizes = np.array([len(b) for b in drawn])
    for observed, trials in ((counts, steps), (sizes, n)):
        law = stats.binom(trials, q)
        edges = np.arange(int(law.ppf(0.01)), int(law.ppf(0.99)) + 1)  # bins inside, both tails merged
        expected = np.diff(np.concatenate([[0.0], law.cdf(edges[:-1]), [1.0]])) * len(observed)
        got = np.bincount(np.searchsorted(edges[:-1], observed, side="left"), minlength=len(edges))
        assert stats.chisquare(got, expected).pvalue > 1e-3
    # two records' inclusions are independent: the joint count of both is S·q² on average
    both = np.array([[i in set(b.tolist()) for i in (0, 1)] for b in drawn]).all(1).sum()
    assert abs(both - steps * q * q) < 5 * (steps * q * q) ** 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_noise_is_standard_normal(dtype):
    z = Draws(seed_key(4), "noise").randn(100_000, dtype=dtype)
    assert z.dtype == dtype
    assert stats.kstest(z.double().numpy(), "norm").pvalue > 1e-3


@pytest.mark.cuda
def test_cuda_noise_is_standard_normal_and_keyed_by_128_bits():
    """Two Philox streams of 64-bit keys, summed: keys that differ only above bit 64 draw other noise."""
    z = Draws(seed_key(4), "noise", "cuda").randn(100_000)
    assert z.device.type == "cuda" and stats.kstest(z.double().cpu().numpy(), "norm").pvalue > 1e-3
    a, b = os_like_keys()
    assert not torch.equal(noise(a, "cuda"), noise(b, "cuda"))


def test_draws_made_ahead_are_handed_out_only_as_they_were_made():
    """A compiled step's probes are made on the host and handed out in order: one asked for in another shape or
    dtype (a draw meant for another layer) is an error, not a silent swap."""
    drawn = Drawn.of(Draws(seed_key(1), "probes"), [((2, 3), torch.float32), ((4,), torch.float64)])
    assert torch.equal(drawn.randn(2, 3), Draws(seed_key(1), "probes").randn(2, 3))
    with pytest.raises(RuntimeError, match=r"draw 1 was made as \(4,\) torch.float64, and is asked for as \(4,\) "
                       r"torch.float32"):
        drawn.randn(4)
    assert torch.equal(drawn.randn(4, dtype=torch.float64), Drawn.of(Draws(seed_key(1), "probes"), [
        ((2, 3), torch.float32), ((4,), torch.float64)]).values[1])
