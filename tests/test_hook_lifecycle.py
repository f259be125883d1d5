"""Engine objects clean up after themselves: every hook a Privatizer or Taps puts on a model is gone
after `close()` or garbage collection, and several of them on one model do not corrupt each other's sums.
Oracle: one backward per sample, clipped by hand."""

import gc
import math

import torch
import torch.nn.functional as F
from torch import nn

from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.privatize import Privatizer
from dpmem.persample import Projection, Taps
from dpmem.privacy.mechanism import GaussianMechanism

C = 0.5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.norm(self.up(x).tanh()).mean(1))


def batch(size=5):
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(size, 3, 4, generator=g, dtype=torch.float64) * torch.linspace(0.1, 4, size).view(-1, 1, 1),
            "y": torch.randint(0, 3, (size,), generator=g)}


def loss_fn(model, b):
    return F.cross_entropy(model(b["x"]), b["y"], reduction="none")


def no_noise():
    return GaussianMechanism(sigma=0.0, max_grad_norm=C, expected_batch_size=1.0, draws=None)


def projection(p: nn.Parameter) -> Projection:
    """A fixed P (4×2) for the columns of the 8×4 up-projection, its smaller side, as DP-GRAPE projects it."""
    P = torch.randn(p.shape[1], 2, generator=torch.Generator().manual_seed(7), dtype=p.dtype) / math.sqrt(2)
    return Projection(P, 1)


def loop_clipped_sum(model, b, project=None):
    """Σᵢ clip(gᵢ, C) from one backward per sample (projected first, if `project` maps a parameter to its P)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = None
    for i in range(len(b["y"])):
        model.zero_grad(set_to_none=True)
        loss_fn(model, {k: v[i:i + 1] for k, v in b.items()}).sum().backward()
        g = [project[p].project(p.grad) if project and p in project else p.grad.clone()
             for p in params]
        norm = torch.sqrt(sum(x.pow(2).sum() for x in g))
        clipped = [x * min(1.0, C / (float(norm) + 1e-6)) for x in g]
        total = clipped if total is None else [a + c for a, c in zip(total, clipped)]
    model.zero_grad(set_to_none=True)
    return dict(zip(params, total))


def hook_count(model: nn.Module) -> int:
    modules = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    params = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return modules + params


def privatized(privatize, model, b, project=None):
    shapes = {p: (project[p].project(p.detach()).shape if project and p in project else p.shape)
              for p in privatize.params}
    summed, _ = privatize.gradient([b], loss_fn, shapes, {p: (lambda P=P: P) for p, P in (project or {}).items()})
    return summed


def test_the_issue_two_live_privatizers_do_not_zero_each_other():
    """Materialize then ghost on one model, neither closed: the ghost sums were all zeros."""
    torch.manual_seed(0)
    model, b = Net().double(), batch()
    want = loop_clipped_sum(model, b)
    first = Privatizer(model, no_noise(), ClippingPlan.of("materialize"))
    second = Privatizer(model, no_noise(), ClippingPlan.of("ghost"))
    for privatize in (first, second, first, second):  # the second round runs after both coverage checks
        got = privatized(privatize, model, b)
        for p in want:
            torch.testing.assert_close(got[p], want[p], rtol=1e-9, atol=1e-12)
    # a plain backward beside them keeps its .grad (their hooks act only inside their own call)
    loss_fn(model, b).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_materialize_ghost_and_grape_one_after_another_each_closed():
    torch.manual_seed(0)
    model, b = Net().double(), batch()
    before = hook_count(model)
    project = {model.up.weight: projection(model.up.weight)}
    for clipping, proj in (("materialize", None), ("ghost", None), ("materialize", project)):
        with Privatizer(model, no_noise(), ClippingPlan.of(clipping)) as privatize:
            assert hook_count(model) > before
            want = loop_clipped_sum(model, b, proj)
            for _ in range(2):  # with and without the first step's coverage check
                got = privatized(privatize, model, b, proj)
                for p in want:
                    torch.testing.assert_close(got[p], want[p], rtol=1e-9, atol=1e-12)
        assert hook_count(model) == before, clipping


def test_hooks_go_when_the_owner_is_garbage_collected():
    model = Net().double()
    before = hook_count(model)
    privatize = Privatizer(model, no_noise(), ClippingPlan.of("ghost"))
    taps = Taps(model)
    assert hook_count(model) > before
    del privatize, taps
    gc.collect()
    assert hook_count(model) == before


def test_close_is_idempotent_and_a_closed_capture_sees_nothing():
    model, b = Net().double(), batch()
    taps = Taps(model)
    taps.close()
    taps.close()
    assert taps.gradients(lambda: loss_fn(model, b).sum(), len(b["y"])) == {}


class TiedNet(nn.Module):
    """Token ids → embedding → a frozen layer → a trained layer → LayerNorm → a head tied to the embedding."""
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.up = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids).detach()  # the embedding's own use gives no gradient: only the head's does
        return self.head(self.norm(self.up(self.frozen(h).tanh())).mean(1)) + 0 * self.embed(ids).sum((1, 2))[:, None]


def test_after_the_coverage_check_no_batch_weight_gradient_is_formed_and_the_sums_still_match():
    """From the second step, linear and LayerNorm weights do not require grad during the backward (their
    per-sample gradients come from the hooks); a layer behind frozen ones still gets its output gradient, and the
    tied embedding keeps its batch gradient path."""
    torch.manual_seed(0)
    model = TiedNet().double()
    g = torch.Generator().manual_seed(1)
    b = {"x": torch.randint(0, 10, (5, 3), generator=g), "y": torch.randint(0, 10, (5,), generator=g)}
    want = loop_clipped_sum(model, b)
    accumulated = []
    model.up.weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(1))
    with Privatizer(model, no_noise(), ClippingPlan.of("materialize")) as privatize:
        for step in range(2):
            got = privatized(privatize, model, b)
            for p in want:
                torch.testing.assert_close(got[p], want[p], rtol=1e-9, atol=1e-12)
            assert len(accumulated) == 0  # taps: even the coverage check takes the batch gradient as a value
    assert all(p.requires_grad for p in (model.up.weight, model.norm.weight, model.embed.weight))
