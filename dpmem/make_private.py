"""`dpmem.api.make_private`: one call for a training loop of one's own, as Opacus' `PrivacyEngine.make_private` is.
Model, optimizer, data and a budget (or σ) in; out, a `PrivateTraining` that samples each step's batch (Poisson, from
a secret key), privatises the gradient into `.grad` (`Privatizer`) and steps the optimizer, and says the ε spent.
Before it returns, the model is checked on the data's first records as `dpmem.api.check` checks it (each module's
rule, the attribution proof under the chosen plan, its step memory); the proof runs again on the first batch."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from dpmem.checking import Check, check
from dpmem.config import resolve_delta
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.privatize import Privatizer
from dpmem.privacy.accounting import Event
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, key_of
from dpmem.privacy.sampling import poisson_batches

CLIPPING = ("bk", "materialize", "ghost", "mixed", "fgc")  # the exact plans (dp-sgd-rc's estimates need its accountant)
CHECKED_RECORDS = 4  # the records `check` runs on: enough for the proof's random weights to tell samples apart


class _Records:
    """Records by index: a dict of equal-length tensors, or a Dataset (a DataLoader's, with its collate_fn)."""

    def __init__(self, data, collate):
        if isinstance(data, DataLoader):
            data, collate = data.dataset, collate or data.collate_fn
        if isinstance(data, dict):
            sizes = {k: len(v) for k, v in data.items() if isinstance(v, torch.Tensor)}
            if not sizes or len(sizes) != len(data) or len(set(sizes.values())) != 1:
                raise ValueError("make_private: data as a dict must map names to tensors of one length (a row per "
                                 f"record); got {({k: type(v).__name__ for k, v in data.items()})}")
            self.n, self.take = next(iter(sizes.values())), lambda index: {k: v[index] for k, v in data.items()}
        elif isinstance(data, Dataset) and hasattr(data, "__len__"):
            collate = collate or default_collate
            self.n, self.take = len(data), lambda index: collate([data[int(i)] for i in index])
        else:
            raise TypeError(f"make_private: data is {type(data).__name__}: allowed a dict of tensors, a Dataset with a "
                            "length, or a DataLoader (its dataset and collate_fn; its batches are not used: the "
                            "batches are Poisson-sampled here)")

    def __call__(self, index: torch.Tensor) -> dict:
        batch = self.take(index)
        if not isinstance(batch, dict):
            raise TypeError(f"make_private: a batch is {type(batch).__name__}, allowed a dict of tensors (the "
                            "loss function's argument, e.g. {'x': images, 'y': labels}): give data as such a dict, "
                            "a Dataset of dicts, or a collate that makes one")
        return batch


class PrivateTraining:
    """A private training loop's state: `step()` takes one logical step, at most `steps` of them (the noise was set
    for that many); `epsilon` is what the steps taken spent, from the mechanism's own σ. `check` is what the check
    before training found (print it)."""

    def __init__(self, model, optimizer, privatizer: Privatizer, loss_fn, event: Event, steps: int,
                 report: Check, records: _Records, batches, physical_batch_size: int | None):
        self.model, self.optimizer, self.privatizer, self.loss_fn = model, optimizer, privatizer, loss_fn
        self.check, self._records, self._batches = report, records, batches
        self._shapes = {p: p.shape for p in privatizer.params}
        self._event, self._steps, self._physical = event, steps, physical_batch_size
        self.taken = 0

    sigma = property(lambda self: self.privatizer.mechanism.sigma, doc="σ, the noise multiplier the steps add")
    delta = property(lambda self: self._event.delta, doc="δ")
    sample_rate = property(lambda self: self._event.sample_rate, doc="q: each record joins each step with this "
                                                                     "probability")
    steps = property(lambda self: self._steps, doc="the steps the noise was set for")

    @property
    def epsilon(self) -> float:
        """ε at `delta` after the steps taken (PLD accountant, Poisson sampling, add/remove neighbours)."""
        return self._event.epsilon(self.taken)

    def step(self) -> None:
        """Sample the next batch, set each trainable parameter's `.grad` to its privatised gradient ((Σ clipped +
        noise) / (q·n)), step the optimizer and zero the gradients. Nothing else is released: the training loss
        is not returned (it would be outside ε); evaluate on held-out data."""
        if self.taken >= self._steps:
            raise RuntimeError(f"make_private: all {self.steps} steps the noise was set for are taken (ε "
                               f"{self.epsilon:.4g}); more would spend more than that. Ask make_private for the steps "
                               "you need: a second loop on the same data spends its ε on top of this one's")
        index = next(self._batches)
        self.taken += 1  # counted once drawn: a step that fails after its release must not go unaccounted
        size = self._physical or max(len(index), 1)
        micro = [self._records(index[i:i + size]) for i in range(0, len(index), size)]  # none: noise alone
        grads, _ = self.privatizer.gradient(micro, self.loss_fn, self._shapes)
        for p in self.privatizer.params:
            p.grad = grads[p]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Remove dpmem's hooks from the model (idempotent)."""
        self.privatizer.close()


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, data, loss_fn, *, batch_size: float,
                 epsilon: float | None = None, noise_multiplier: float | None = None, delta: float | str = "auto",
                 max_grad_norm: float = 1.0, steps: int | None = None, epochs: float | None = None,
                 clipping: str = "bk", physical_batch_size: int | None = None, seed: int | None = None,
                 collate_fn=None) -> PrivateTraining:
    """A private training loop for `model` and `optimizer` (over the model's parameters) on `data`.

    Args:
        data (dict | Dataset | DataLoader): a dict of equal-length tensors ({"x": images, "y": labels}), a Dataset
            of dicts (with a length), or a DataLoader (its dataset and collate_fn: the batches are Poisson-sampled
            here, not the loader's).
        loss_fn (Callable): `loss_fn(model, batch)` returns one loss per sample (`reduction="none"`).
        batch_size: the expected batch size q·n (each record joins each step with probability q).
        epsilon: the budget: σ is calibrated to it over the steps (PLD accountant). Give it or `noise_multiplier`.
        noise_multiplier: a fixed σ instead; `epsilon` then says what the steps taken spent.
        delta: δ, or "auto": min(1e-5, 1/n^1.1), as `dpmem train`.
        max_grad_norm: C, each sample's gradient clipped to it (flat, over every trainable parameter).
        steps: the steps to take. Give it or `epochs`.
        epochs: epochs of n records each instead: steps = ⌈epochs · n / batch_size⌉.
        clipping: bk (book-keeping), materialize, ghost, mixed or fgc (`ClippingPlan`).
        physical_batch_size: records per forward/backward pass (memory); the logical batch is unchanged.
        seed: the secret key's seed for reproducible batches and noise (not secret then); None: the OS's entropy.
        collate_fn (Callable | None): makes a batch of a Dataset's records (default: the DataLoader's, or torch's
            default_collate).
    """
    records = _Records(data, collate_fn)
    n = records.n
    if (epsilon is None) == (noise_multiplier is None):
        raise ValueError("make_private: give epsilon (a budget) or noise_multiplier (a fixed σ), exactly one")
    if (steps is None) == (epochs is None):
        raise ValueError("make_private: give steps or epochs, exactly one")
    if not 0 < batch_size <= n:
        raise ValueError(f"make_private: batch_size {batch_size}: the expected batch, in (0, n = {n}]")
    if clipping not in CLIPPING:
        raise ValueError(f"make_private: clipping {clipping!r}: allowed {', '.join(CLIPPING)}")
    q = batch_size / n
    steps = steps if steps is not None else math.ceil(epochs * n / batch_size)  # n records an epoch
    event = Event(0.0, resolve_delta(delta, n), q)  # PLD, Poisson sampling, add/remove neighbours
    event = event.calibrated(epsilon, steps) if epsilon is not None else replace(event, sigma=float(noise_multiplier))
    sigma = event.sigma
    report = check(model, loss_fn, records(torch.arange(min(CHECKED_RECORDS, n))), plans=(clipping,))
    key = key_of(seed)
    noise = GaussianMechanism(sigma, max_grad_norm, expected_batch_size=q * n, draws=Draws(key, "noise"))
    privatizer = Privatizer(model, noise, ClippingPlan.of(clipping))
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in optimized]
    if left:
        privatizer.close()
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise ValueError(f"make_private: the optimizer does not update {left[0]}{more}, a trainable parameter: build "
                         "it over the model's parameters, or freeze what it should not train")
    return PrivateTraining(model, optimizer, privatizer, loss_fn, event, steps, report, records,
                           poisson_batches(n, q, steps, Draws(key, "batches")), physical_batch_size)
