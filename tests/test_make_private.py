"""`dpmem.api.make_private`: one call for a loop of one's own. Its step against a loop of one-sample backward passes
with the noise replayed from its key; its ε against dp-accounting's PLD built here; what it refuses, before any
step."""

import dp_accounting
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpmem.api import make_private
from dpmem.privacy.randomness import Draws, key_of
from dpmem.privacy.sampling import poisson_batches
from helpers import loop_grads, standard_noise

N, D = 40, 6

pytestmark = pytest.mark.usefixtures("float64")


def records(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(N, D, generator=g), "y": torch.randint(0, 3, (N,), generator=g)}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 3))


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def dp_accounting_epsilon(sigma, q, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(event).get_epsilon(delta)


def test_each_step_is_the_clipped_sum_plus_its_noise_over_the_expected_batch():
    """SGD at lr 1 moves each weight by its private gradient: (Σᵢ min(1, C/‖gᵢ‖) gᵢ + σC z) / (q·n), gᵢ from a
    backward pass per sample, z the noise's draws from the seed's key, the batch the sampler's; in micro-batches of
    3 records."""
    data, C, sigma, b = records(), 0.5, 0.7, 8
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    private = make_private(model, optimizer, data, loss_fn, batch_size=b, noise_multiplier=sigma, max_grad_norm=C,
                           steps=3, physical_batch_size=3, seed=5)
    batches = poisson_batches(N, b / N, 3, Draws(key_of(5), "batches"))
    noise = Draws(key_of(5), "noise")
    for _ in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        index = next(batches)
        per = loop_grads(model, loss_fn, {k: v[index] for k, v in data.items()}, len(index))
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
        factors = (C / (norms + 1e-6)).clamp(max=1.0)
        z = dict(zip(per, standard_noise([p.shape for p in model.parameters()], noise, torch.float64)))
        private.step()
        for name, p in model.named_parameters():
            want = (torch.einsum("b,b...->...", factors, per[name]) + sigma * C * z[name]) / b
            assert torch.allclose(before[name] - p.detach(), want, rtol=1e-9, atol=1e-12), name
    assert private.taken == 3
    with pytest.raises(RuntimeError, match=r"all 3 steps the noise was set for are taken"):
        private.step()
    private.close()


def test_a_budget_is_met_and_its_epsilon_is_dp_accountings():
    """σ calibrated to ε 4 over 2 epochs (⌈2 / q⌉ = 10 steps): the ε of the steps taken, at each count, is what
    dp-accounting's PLD composes for them, and at the end within the budget."""
    model = mlp()
    private = make_private(model, torch.optim.Adam(model.parameters()), records(), loss_fn, batch_size=8, epsilon=4.0,
                           delta=1e-5, epochs=2, seed=0)
    assert private.steps == 10 and private.epsilon == 0.0
    for taken in (1, 10):
        while private.taken < taken:
            private.step()
        theirs = dp_accounting_epsilon(private.sigma, 0.2, taken, 1e-5)
        assert private.epsilon == pytest.approx(theirs, rel=2e-3)
    assert private.epsilon <= 4.0 and dp_accounting_epsilon(private.sigma, 0.2, 10, 1e-5) <= 4.0 * (1 + 2e-3)
    private.close()


def test_a_step_that_fails_after_its_batch_is_drawn_is_still_counted():
    """ε never under-states: a step counts once its batch is drawn, whether or not it got as far as its release."""
    model, broken = mlp(), []

    def failing(m, b):
        if broken:
            raise RuntimeError("a failing loss")
        return loss_fn(m, b)
    private = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), records(), failing, batch_size=8,
                           noise_multiplier=1.0, steps=2, seed=0)
    broken.append(True)  # after the check before training
    with pytest.raises(RuntimeError, match="a failing loss"):
        private.step()
    assert private.taken == 1
    assert private.epsilon == pytest.approx(dp_accounting_epsilon(1.0, 0.2, 1, private.delta), rel=2e-3)
    private.close()


class DictRecords(Dataset):
    def __init__(self, data, tuples=False):
        self.data, self.tuples = data, tuples

    def __len__(self):
        return N

    def __getitem__(self, i):
        x, y = self.data["x"][i], self.data["y"][i]
        return (x, y) if self.tuples else {"x": x, "y": y}


def test_a_dataloader_gives_its_dataset_and_steps_as_a_dict_of_tensors_does():
    """A DataLoader's dataset and collate_fn are used; its own batches are not (they are Poisson-sampled)."""
    moved = []
    for data in (records(), DataLoader(DictRecords(records()), batch_size=5, shuffle=True)):
        model = mlp()
        private = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn, batch_size=8,
                               noise_multiplier=1.0, steps=2, seed=1)
        private.step()
        private.step()
        private.close()
        moved.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(moved[0], moved[1])


class BatchNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(D, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(self.norm(self.a(x)))


REFUSED = {
    "two budgets": (dict(epsilon=2.0, noise_multiplier=1.0), ValueError, r"exactly one"),
    "no budget": (dict(), ValueError, r"give epsilon \(a budget\) or noise_multiplier"),
    "steps and epochs": (dict(noise_multiplier=1.0, epochs=1), ValueError, r"give steps or epochs, exactly one"),
    "batch above n": (dict(noise_multiplier=1.0, batch_size=41), ValueError, r"batch_size 41: the expected batch, in "
                                                                             r"\(0, n = 40\]"),
    "estimated clipping": (dict(noise_multiplier=1.0, clipping="hutch"), ValueError, r"clipping 'hutch': allowed bk"),
    "mixing loss": (dict(noise_multiplier=1.0, loss=lambda m, b: loss_fn(m, b).mean().expand(len(b["y"]))),
                    RuntimeError, r"the loss function mixes samples"),
    "batch norm": (dict(noise_multiplier=1.0, model=BatchNormed), ValueError, r"norm: BatchNorm1d mixes samples"),
    "optimizer misses a weight": (dict(noise_multiplier=1.0, some=True), ValueError,
                                  r"the optimizer does not update 0\.weight, a trainable parameter"),
    "tuple records": (dict(noise_multiplier=1.0, data=DictRecords(records(), tuples=True)), TypeError,
                      r"a batch is list, allowed a dict of tensors"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_train_privately_is_refused_in_one_line_before_a_step(case):
    kwargs, error, words = REFUSED[case]
    kwargs = dict(kwargs)
    model = kwargs.pop("model", mlp)()
    params = list(model.parameters())[1:] if kwargs.pop("some", False) else model.parameters()
    data, loss = kwargs.pop("data", records()), kwargs.pop("loss", loss_fn)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=words):
        make_private(model, torch.optim.SGD(params, lr=1.0), data, loss, **{"batch_size": 8, "steps": 2, **kwargs})
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
