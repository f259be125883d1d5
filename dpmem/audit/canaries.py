"""Gradient canaries: white-box one-run auditing (Steinke, Nasr, Jagielski 2023, §6's gradient-space canaries).

A canary is a per-sample gradient planted directly: a Dirac vector of norm `norm` (a multiple of C, so that the
method's clipping has work to do) on one coordinate of the quantity the method privatises. Each of the m canaries
is in the training set with probability ½ (the audit's secret bits); an included canary is Poisson-sampled at the
run's rate q every step, like a real example, passes through the same clipping as the real examples' gradients,
and is summed with them before the noise. Its score is the sum over steps of the released value at its
coordinate: the auditor who sees every privatised gradient (the threat model DP-SGD's accounting assumes).

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


class GradientCanaries:
    def __init__(self, m: int, sample_rate: float, norm: float, seed: int):
        if m < 2:
            raise ValueError(f"audit.canaries={m}: need at least 2")
        self.m, self.sample_rate, self.norm = m, sample_rate, norm
        self.gen = torch.Generator().manual_seed(seed)
        self.included = torch.rand(m, generator=self.gen) < 0.5  # the secret bits
        self.scores = torch.zeros(m, dtype=torch.float64)
        self.where: dict | None = None  # key -> (canary ids, flat indices), placed at the first step
        self.sampled = torch.zeros(m, dtype=torch.bool)
        self.untouched = False  # placed where the first step's real gradients were zero

    def place(self, shapes: dict, untouched: torch.Tensor | None = None) -> None:
        """m distinct coordinates over all privatised coordinates (keys in their order, flattened): among the
        `untouched` ones (a flat bool mask) if there are m of them, uniformly otherwise."""
        sizes = torch.tensor([int(torch.Size(s).numel()) for s in shapes.values()])
        total = int(sizes.sum())
        if total < self.m:
            raise ValueError(f"{self.m} canaries need as many coordinates; the method privatises {total}")
        if untouched is not None and int(untouched.sum()) >= self.m:
            free = untouched.nonzero().flatten()
            flat = free[torch.randperm(len(free), generator=self.gen)[:self.m]]
        else:
            flat = torch.randperm(total, generator=self.gen)[:self.m] if total <= 10**7 else self._distinct(total)
        self.untouched = untouched is not None and int(untouched.sum()) >= self.m
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

    def sample(self) -> torch.Tensor:
        """This step's Poisson sample of the included canaries (rate q, as for real examples)."""
        self.sampled = self.included & (torch.rand(self.m, generator=self.gen) < self.sample_rate)
        return self.sampled

    # -- first-order methods: planted into the clipped sums, scored on the released gradient ---------------------
    def plant(self, summed: dict, clip_factors) -> None:
        """Add the sampled canaries, clipped by `clip_factors(norms)` as real gradients are, to `summed`."""
        if self.where is None:
            small = sum(s.numel() for s in summed.values()) <= 10**8  # the mask is a byte per coordinate, on the host
            zero = torch.cat([(s == 0).reshape(-1).cpu() for s in summed.values()]) if small else None
            self.place({key: s.shape for key, s in summed.items()}, zero)
        sampled = self.sample()
        if not sampled.any():
            return
        norms = torch.full((int(sampled.sum()),), float(self.norm))
        value = float((clip_factors(norms) * norms)[0])  # every canary has the same norm
        for key, (ids, flat) in self.where.items():
            hit = flat[sampled[ids]]
            if len(hit):
                s = summed[key].view(-1)
                s.index_add_(0, hit.to(s.device), torch.full((len(hit),), value, device=s.device, dtype=s.dtype))

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
