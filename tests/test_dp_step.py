"""The private step: clipped sums against Opacus, the noise and its normalisation, micro-batching, meta device."""

import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from dpmem.metering import LiveTensorCounter
from dpmem.methods import DPAdam, method_config
from dpmem.methods.privatize import Observer, Privatizer
from dpmem.persample import Taps, clip_factors, per_sample_norms, weighted_sum
from dpmem.privacy import mechanism
from dpmem.privacy.mechanism import GaussianMechanism
from helpers import seeded, standard_noise
from tiny_models import tiny_vit



class Net(nn.Module):
    """Every layer type that Opacus and dpmem both support."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(2 * 16 + 4 * 3, 3)

    def forward(self, x, ids):
        a = self.conv(x).relu().flatten(1)
        b = self.norm(self.emb(ids)).flatten(1)
        return self.fc(torch.cat([a, b], 1))


def make_batch(size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(size, 1, 4, 4, generator=g) * torch.linspace(0.1, 5, size).view(-1, 1, 1, 1),
            "ids": torch.randint(0, 10, (size, 3), generator=g), "y": torch.randint(0, 3, (size,), generator=g)}


def loss_fn(model, b):
    return F.cross_entropy(model(b["x"], b["ids"]), b["y"], reduction="none")


def method_cfg(optimizer="sgd", C=1.0, check_coverage=True):
    return method_config("dp-sgd", optimizer=optimizer, max_grad_norm=C, check_coverage=check_coverage)


def test_clipped_sum_equals_opacus():
    torch.manual_seed(0)
    model, batch, C = Net(), make_batch(), 5.0
    # ours
    taps = Taps(model)
    grads = taps.gradients(lambda: loss_fn(model, batch).sum(), 8)
    norms = per_sample_norms(grads)
    assert (norms > C).any() and (norms < C).any(), "the batch should be partly clipped"
    ours = weighted_sum(grads, clip_factors(norms, C))
    taps.close()
    model.zero_grad(set_to_none=True)
    # Opacus
    gsm = GradSampleModule(model, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=C,
                      expected_batch_size=8, loss_reduction="sum")
    F.cross_entropy(gsm(batch["x"], batch["ids"]), batch["y"], reduction="sum").backward()
    opt.clip_and_accumulate()
    for p in model.parameters():
        torch.testing.assert_close(ours[p], p.summed_grad, rtol=1e-5, atol=1e-7)


def test_private_gradient_is_clipped_sum_plus_noise_over_expected_batch():
    torch.manual_seed(0)
    model, batch = Net(), make_batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sigma, C, expected = 0.7, 5.0, 10.0  # the expected batch size, not the 8 sampled
    method = DPAdam(model, method_cfg("sgd", C), lr=1.0,
                    mechanism=GaussianMechanism(sigma, C, expected, seeded(123)))
    method.step([batch], loss_fn)
    # oracle: Opacus' clipped sum and the same noise draws, in dpmem's parameter order
    reference = Net()
    reference.load_state_dict(before)
    gsm = GradSampleModule(reference, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=C,
                      expected_batch_size=8, loss_reduction="sum")
    F.cross_entropy(gsm(batch["x"], batch["ids"]), batch["y"], reduction="sum").backward()
    opt.clip_and_accumulate()
    summed = {n: p.summed_grad for n, p in reference.named_parameters()}
    gen = seeded(123)
    names = {p: n for n, p in model.named_parameters()}
    for p, noise in zip(method.params, standard_noise([p.shape for p in method.params], gen)):
        n = names[p]
        want = before[n] - (summed[n] + sigma * C * noise) / expected  # SGD with lr 1
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)


def test_micro_batches_accumulate_to_the_same_step():
    updates = []
    for chunks in (1, 4):
        torch.manual_seed(0)
        model = Net()
        method = DPAdam(model, method_cfg("adam", 0.5), lr=0.1, mechanism=GaussianMechanism(0.0, 0.5, 8.0, None))
        batch = make_batch()
        micro = [{k: v[i::chunks] for k, v in batch.items()} for i in range(chunks)]
        method.step(micro, loss_fn)
        updates.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(updates[0], updates[1], rtol=1e-5, atol=1e-6)


def test_empty_batch_still_adds_noise():
    torch.manual_seed(0)
    model = Net()
    before = [p.detach().clone() for p in model.parameters()]
    method = DPAdam(model, method_cfg("sgd", 1.0), lr=1.0, mechanism=GaussianMechanism(1.0, 1.0, 4.0, seeded(0)))
    method.step([], loss_fn)
    assert all(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


def test_noise_is_drawn_in_runs_of_bounded_size_split_in_order(monkeypatch):
    """Runs of consecutive sums of one dtype, at most NOISE_BUCKET elements together, a larger sum alone; each run
    one standard normal vector split into its sums."""
    monkeypatch.setattr(mechanism, "NOISE_BUCKET", 16)
    shapes = [(3, 4), (5,), (20,), (2,), (2, 2)]
    summed = {i: torch.zeros(shape, dtype=torch.float64 if i == 4 else torch.float32)
              for i, shape in enumerate(shapes)}
    GaussianMechanism(0.5, 2.0, 1.0, seeded(3)).release(summed)
    gen = seeded(3)
    runs = [[0], [1], [2], [3], [4]]  # 12 + 5 > 16; 20 alone; float32 then float64
    for run in runs:
        draw = gen.randn(sum(summed[i].numel() for i in run), dtype=summed[run[0]].dtype)
        for i, chunk in zip(run, draw.split([summed[i].numel() for i in run])):
            torch.testing.assert_close(summed[i], 1.0 * chunk.view(shapes[i]), rtol=0, atol=0)
    summed = {i: torch.zeros(n) for i, n in enumerate([6, 7, 4])}  # 6 + 7 fit, 4 more do not
    GaussianMechanism(1.0, 1.0, 1.0, seeded(4)).release(summed)
    gen = seeded(4)
    first = gen.randn(13)
    assert torch.equal(torch.cat([summed[0], summed[1]]), first)
    assert torch.equal(summed[2], gen.randn(4))


def test_the_attribution_proof_catches_a_parameter_used_outside_its_module():
    class Sneaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x, ids=None):
            return self.fc(x) + x @ self.fc.weight  # the second use bypasses the Linear's hooks

    model = Sneaky()
    method = DPAdam(model, method_cfg(), lr=0.1, mechanism=GaussianMechanism(0.0, 1.0, 4.0, None))
    batch = {"x": torch.randn(4, 3), "y": torch.randint(0, 3, (4,))}
    with pytest.raises(RuntimeError, match="fc.weight.*used outside the module that owns it"):
        method.step([batch], lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none"))


def net_case():
    return Net(), loss_fn, make_batch()


def _counted_step(make, device):
    torch.manual_seed(0)
    with torch.device(device):
        model, loss, batch = make()
    batch = {k: v.to(device) for k, v in batch.items()}
    # the one-off coverage check computes on real tensors only, so it is off for this comparison
    method = DPAdam(model, method_cfg("adam", 1.0, check_coverage=False), lr=0.1,
                    mechanism=GaussianMechanism(1.0, 1.0, 8.0, None))
    with LiveTensorCounter().track_state(model, method) as counter:
        for _ in range(2):  # the second step holds the Adam moments
            method.step([batch], loss)
    return model, counter.peak


def eager_vit():
    return tiny_vit(attn="eager")  # SDPA picks a fused kernel on CPU and the math path on meta


@pytest.mark.parametrize("make", [net_case, eager_vit], ids=["conv-emb-ln-linear", "vit"])
def test_a_private_step_runs_on_meta_with_the_same_peak_as_cpu(make):
    model, meta_peak = _counted_step(make, "meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    _, cpu_peak = _counted_step(make, "cpu")
    assert meta_peak == cpu_peak > 0


class Recording(Observer):
    """Records what it sees (copies) and where it stands in the calls; `factor` replaces the clipped sums."""

    def __init__(self, name, calls, factor=1.0):
        self.name, self.calls, self.factor, self.clipped, self.released = name, calls, factor, None, None

    def on_clipped(self, privatizer, summed):
        self.calls.append(("clipped", self.name))
        self.clipped = {p: s.clone() for p, s in summed.items()}
        return {p: s * self.factor for p, s in summed.items()}

    def on_noised(self, privatizer, released):
        self.calls.append(("noised", self.name))
        self.released = {p: s.clone() for p, s in released.items()}
        return released


def test_observers_see_the_clipped_sums_in_order_and_the_release_in_reverse():
    """An observer on the mechanism sees the clipped sums (Opacus' oracle) and may replace them: the release is
    (its replacement + the same noise) / (q·n), and observers after it see the replacement; after the noise they
    are called in reverse order, the first seeing the final release."""
    torch.manual_seed(0)
    model, batch = Net(), make_batch()
    sigma, C, expected = 0.7, 5.0, 10.0
    calls = []
    first, second = Recording("first", calls, factor=2.0), Recording("second", calls)
    with Privatizer(model, GaussianMechanism(sigma, C, expected, seeded(123), observers=(first, second))) \
            as privatizer:
        released, _ = privatizer.gradient([batch], loss_fn, {p: p.shape for p in privatizer.params})
    assert calls == [("clipped", "first"), ("clipped", "second"), ("noised", "second"), ("noised", "first")]
    reference = GradSampleModule(Net(), loss_reduction="sum")
    reference._module.load_state_dict(model.state_dict())
    opt = DPOptimizer(torch.optim.SGD(reference.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=C,
                      expected_batch_size=8, loss_reduction="sum")
    F.cross_entropy(reference(batch["x"], batch["ids"]), batch["y"], reduction="sum").backward()
    opt.clip_and_accumulate()
    summed = {n: p.summed_grad for n, p in reference._module.named_parameters()}
    gen = seeded(123)
    named = list(model.named_parameters())
    for (n, p), noise in zip(named, standard_noise([p.shape for _, p in named], gen)):
        torch.testing.assert_close(first.clipped[p], summed[n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(second.clipped[p], 2 * summed[n], rtol=1e-5, atol=1e-6)
        want = (2 * summed[n] + sigma * C * noise) / expected
        torch.testing.assert_close(released[p], want, rtol=1e-5, atol=1e-6)
        assert torch.equal(first.released[p], released[p]) and torch.equal(second.released[p], released[p])
