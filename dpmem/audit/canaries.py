"""The canaries of `dpmem audit`. Input canaries (black-box) are mislabelled training examples, scored by the final
model's loss on them. Gradient canaries: white-box one-run auditing (Steinke, Nasr, Jagielski 2023, §6's gradient-space canaries).

A canary is a per-sample gradient planted directly: a Dirac vector of norm `norm` (a multiple of C, so that the
method's clipping has work to do) on one coordinate of the quantity the method privatises. Each of the m canaries
is in the training set with probability ½ (the audit's secret bits); an included canary is Poisson-sampled at the
run's rate q every step, like a real example, is normed, clipped and summed by the Privatizer's own code for real
samples (given as one-hot factors, the form a layer's per-sample gradient takes), and added to their clipped sum
before the noise. Its score is the sum over steps of the released value at its coordinate: the auditor who sees
every privatised gradient (the threat model DP-SGD's accounting assumes).

Where the canary lives is where the mechanism looks:
- dp-adam, dp-sgd, galore-dp-naive, dp-sgd-rc: a coordinate of a parameter's gradient;
- grape: a coordinate of a projected matrix's r-dimensional gradient (Pᵀ G), the only thing it privatises (the
  gradient Pᵀ-lifted from that Dirac is what the projection maps onto it);
- dpzero: a Dirac gradient c in parameter space, seen through the step's random direction as the scalar ⟨c, z⟩,
  clipped to [-C, C] with the real samples' scalars; its score is Σₜ g̃ₜ·clip(⟨c, zₜ⟩)/C.
First-order canaries go where the first step's real clipped sum is exactly zero, where there are enough such
coordinates (rows of unused tokens' embeddings, weights of always-zero inputs), and uniformly at random otherwise.
The choice depends on the real data only, not on which canaries are in, so the bound stays valid; real gradients
on a canary's coordinate add background to its score, which weakens the bound but never invalidates it.
"""

from __future__ import annotations

import torch

from dpmem.config import ConfigError
from dpmem.methods.privatize import Observer


class GradientCanaries(Observer):
    """The Privatizer's observer (planted in the clipped sums, scored on the release), or DPZero's (its scalars)."""

    def __init__(self, m: int, norm: float, seed: int):
        if m < 2:
            raise ValueError(f"audit.canaries={m}: need at least 2")
        self.m, self.norm = m, norm
        self.gen = torch.Generator().manual_seed(seed)
        self.included = torch.rand(m, generator=self.gen) < 0.5  # the secret bits
        self.scores = torch.zeros(m, dtype=torch.float64)
        self.where: dict | None = None  # key -> (canary ids, flat indices), placed at the first step
        self.untouched = False  # placed where the first step's real gradients were zero

    def place(self, shapes: dict, untouched: torch.Tensor | None = None) -> None:
        """m distinct coordinates over all privatised coordinates (keys in their order, flattened): among the
        `untouched` ones (a flat bool mask) if there are m of them, uniformly otherwise."""
        sizes = torch.tensor([int(torch.Size(s).numel()) for s in shapes.values()])
        total = int(sizes.sum())
        if total < self.m:
            raise ValueError(f"{self.m} canaries need as many coordinates; the method privatises {total}")
        free = untouched.nonzero().flatten() if untouched is not None else None
        self.untouched = free is not None and len(free) >= self.m
        if self.untouched:
            flat = free[torch.randperm(len(free), generator=self.gen)[:self.m]]
        else:
            flat = torch.randperm(total, generator=self.gen)[:self.m] if total <= 10**7 else self._distinct(total)
        ends = sizes.cumsum(0)
        owner = torch.searchsorted(ends, flat, right=True)
        self.where = {}
        for i, key in enumerate(shapes):
            ids = (owner == i).nonzero().flatten()
            if len(ids):
                self.where[key] = (ids, flat[ids] - (ends[i] - sizes[i]))

    def _distinct(self, total: int) -> torch.Tensor:
        seen: dict[int, None] = {}
        while len(seen) < self.m:
            for j in torch.randint(total, (2 * self.m,), generator=self.gen).tolist():
                seen.setdefault(j, None)
        return torch.tensor(list(seen)[:self.m])

    def sample(self, rate: float) -> torch.Tensor:
        """This step's Poisson sample of the included canaries (the run's rate q, as for real examples)."""
        return self.included & (torch.rand(self.m, generator=self.gen) < rate)

    # -- first-order methods: planted into the clipped sums, scored on the released gradient ---------------------
    def on_clipped(self, privatizer, summed: dict) -> dict:
        self.plant(summed, privatizer.clipped_sum_of, privatizer.noise.sample_rate)
        return summed

    def on_noised(self, privatizer, released: dict) -> dict:
        self.record(released)
        return released

    def plant(self, summed: dict, clipped_sum, rate: float) -> None:
        """Add the sampled canaries to `summed`, clipped and summed by `clipped_sum` (the Privatizer's own code for
        real samples: norm rule, clip factors, weighted sum) from their per-sample gradients, one Dirac each."""
        if self.where is None:
            small = sum(s.numel() for s in summed.values()) <= 10**8  # the mask is a byte per coordinate, on the host
            zero = torch.cat([(s == 0).reshape(-1).cpu() for s in summed.values()]) if small else None
            self.place({key: s.shape for key, s in summed.items()}, zero)
        sampled = self.sample(rate)
        for key, (ids, flat) in self.where.items():
            hit = flat[sampled[ids]]
            if len(hit):  # each canary lives in one key: its norm there is its whole norm
                summed[key] += clipped_sum({key: self._diracs(summed[key], hit)})[key].to(summed[key].dtype)

    def _diracs(self, like: torch.Tensor, flat: torch.Tensor):
        """Per-sample gradients of canaries at `flat` coordinates of `like`'s shape, one row each: `norm` there, zero
        elsewhere. A matrix's as `Factored` (one-hot left and right factors at one position), the form its layer's
        per-sample gradients take; a vector's dense."""
        from dpmem.persample.factored import Factored
        at, flat = torch.arange(len(flat), device=like.device), flat.to(like.device)
        if like.dim() < 2:
            dense = torch.zeros(len(flat), like.numel(), device=like.device, dtype=like.dtype)
            dense[at, flat] = self.norm
            return dense.reshape(len(flat), *like.shape)
        rows, cols = like.shape[0], like[0].numel()
        left = torch.zeros(len(flat), 1, rows, device=like.device, dtype=like.dtype)
        right = torch.zeros(len(flat), 1, cols, device=like.device, dtype=like.dtype)
        left[at, 0, flat // cols] = self.norm
        right[at, 0, flat % cols] = 1.0
        return Factored.outer(left, right, param_shape=like.shape)

    def record(self, released: dict) -> None:
        for key, (ids, flat) in self.where.items():
            self.scores[ids] += released[key].reshape(-1)[flat.to(released[key].device)].double().cpu()

    # -- zeroth-order: seen through the direction --------------------------------------------------------------
    def directional(self, directions) -> torch.Tensor:
        """⟨cᵢ, z⟩ for every canary, from `directions` = [(parameter, z)] of this step (placed at the first)."""
        directions = list(directions)
        if self.where is None:
            self.place({p: p.shape for p, _ in directions})
        values = torch.zeros(self.m, dtype=torch.float64)
        for p, z in directions:
            if p in self.where:
                ids, flat = self.where[p]
                values[ids] = self.norm * z.reshape(-1)[flat.to(z.device)].double().cpu()
        return values

    def record_scalar(self, released: float, clipped: torch.Tensor, max_grad_norm: float) -> None:
        self.scores += released * clipped / max_grad_norm


class InputCanaries:
    """Black-box canaries: m training examples given a wrong label; the included ones stay in the training set,
    the others leave it. Score: minus the final model's loss on the canary with its wrong label."""

    def __init__(self, m: int, seed: int):
        self.m, self.gen = m, torch.Generator().manual_seed(seed)
        self.included = torch.rand(m, generator=self.gen) < 0.5
        self.examples: dict[str, torch.Tensor] = {}
        self.scores = torch.zeros(m, dtype=torch.float64)

    def plant(self, data):
        """Take m examples out of `data`'s training split, mislabel them, put the included ones back."""
        if not data.num_classes or "labels" not in data.train:
            raise ConfigError("audit.kind", "input canaries mislabel examples, which needs a classification task; "
                              "use audit.kind=gradient")
        if data.n_train < 2 * self.m:
            raise ConfigError("audit.canaries", f"{self.m} input canaries need at least {2 * self.m} training "
                              f"examples; the training set has {data.n_train}")
        order = torch.randperm(data.n_train, generator=self.gen)
        chosen, rest = order[:self.m], order[self.m:]
        self.examples = {k: v[chosen].clone() for k, v in data.train.items()}
        shift = torch.randint(1, data.num_classes, (self.m,), generator=self.gen)
        self.examples["labels"] = (self.examples["labels"] + shift) % data.num_classes
        kept = {k: v[self.included] for k, v in self.examples.items()}
        data.train = {k: torch.cat([v[rest], kept[k]]) for k, v in data.train.items()}
        return data

    @torch.no_grad()
    def score(self, parts, batch: int) -> None:
        """Minus the trained model's loss on each canary (with its wrong label), `batch` at a time."""
        parts.model.eval()
        losses = []
        for start in range(0, self.m, batch):
            part = parts.data.batch(self.examples, slice(start, start + batch))
            mb = {k: v.to(parts.device) for k, v in part.items()}
            with parts.autocast():
                losses.append(parts.per_sample_loss(parts.model, mb).double().cpu())
        self.scores = -torch.cat(losses)
