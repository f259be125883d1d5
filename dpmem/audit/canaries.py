"""The canaries of `dpmem audit`. Input canaries (black-box) are mislabelled training examples, scored by the final
model's loss on them. Gradient canaries: white-box one-run auditing (Steinke, Nasr, Jagielski 2023, §6's gradient-space
canaries).

A canary is a per-sample gradient: a Dirac vector of norm `norm` (a multiple of C, so that the method's clipping has
work to do) on one coordinate of the quantity the method privatises. Each of the m canaries is in the training set
with probability ½ (the audit's secret bits); an included canary is Poisson-sampled at the run's rate q every
step, like a real example, and normed, clipped and summed by the Privatizer's own code for real samples. Its score
is the sum over steps of the released value at its coordinate: the auditor who sees every privatised gradient (the
threat model DP-SGD's accounting assumes). Planted in the sum, the real samples' clipped sum there is taken out of
each step's value first: the white-box auditor sees it, and it does not depend on which canaries are in, so the
bound stays valid and the score loses the real gradients' background.

Two ways in (`audit.plant`):
- sum: the canaries' per-sample gradients are handed to the Privatizer's `clipped_sum_of` (given as one-hot
  factors) and added to the real clipped sum before the noise. They see the norm rule, the clip factors, the
  weighted sum, the noise and the accounting, but not the path real samples take to them.
- batch (`BatchCanaries`, the default where the method allows): the step's sampled canaries join as a micro-batch of
  their own, after the real ones, each a sample: a copy of a real row whose loss is replaced by one whose gradient
  is the canary: the layers that own its host weight (nn.Linear, nn.Embedding: a tied weight's every owner) are
  called on one-hot inputs and output gradients, `audit.uses` times, each call contributing norm/uses at the
  canary's coordinate. So it goes wherever a real sample goes: the layers' hooks and rules, the sum over a weight's
  uses, the norm of that sum, the clip factors and weighted sums of its micro-batch (one pass or two), the
  accumulation over micro-batches. A norm taken per use sees 16 uses of norm C·norm/16 each, and lets √16 = 4 times
  C through. The canaries are placed at the first step (whose micro-batches no canary joins), from its clipped sums,
  over every trainable nn.Linear and nn.Embedding weight (biases and norms' weights cannot host one).

Besides the bound, the released values at the coordinates of the canaries left out, less the real samples' clipped
sum there, are compared with the claimed noise: their mean square, in units of C/(q·n), is σ² under the claim, so a
chi-squared lower tail below 10⁻⁶ shows noise smaller than claimed (`dpmem.audit.bound.noise_check`), whatever
stage added it.

Where the canary lives is where the mechanism looks:
- dp-adam, dp-sgd, galore-dp-naive, dp-sgd-rc: a coordinate of a parameter's gradient;
- grape: a coordinate of a projected matrix's r-dimensional gradient (Pᵀ G), the only thing it privatises (the
  gradient Pᵀ-lifted from that Dirac is what the projection maps onto it);
- dpzero: a Dirac gradient c in parameter space, seen through the step's random direction as the scalar ⟨c, z⟩,
  clipped to [-C, C] with the real samples' scalars; its score is Σₜ g̃ₜ·clip(⟨c, zₜ⟩)/C.
The canaries are spread over the model, every parameter holding some (half of them in equal shares, the rest in
proportion to size), so that a fault in any one layer moves some of them; the bound is one audit over all of them,
its guesses made among all and among each weight's own (`bound.audit_bound`). Within a parameter, first-order
canaries go where the first step's real clipped sum is exactly zero, where it has enough such coordinates (rows of
unused tokens' embeddings, weights of always-zero inputs), and uniformly at random otherwise.
The choice depends on the real data only, not on which canaries are in, so the bound stays valid.
"""

from __future__ import annotations

import torch
from torch import nn

from dpmem import distributed
from dpmem.config import ConfigError
from dpmem.data.bundle import Padded
from dpmem.methods.base import batch_size
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
        self.untouched = False  # every canary placed where the first step's real gradients were zero
        self.background: dict | None = None  # the step's real clipped sum at the canaries' coordinates (by key)
        # the released values at the left-out canaries' coordinates, in units of C/(q·n): their count and squares
        self.sigma, self.noise_count, self.noise_squares = None, 0, 0.0
        # every released tensor at every step, in the same units: Σ y² over its coordinates (steps × tensors), and
        # each tensor's size and name (`bound.whole_noise_check`)
        self.step_squares: list[list[float]] = []
        self.tensor_sizes: list[int] = []
        self.tensor_keys: list = []

    def place(self, shapes: dict, untouched: dict | None = None, allowed: dict | None = None) -> None:
        """m distinct coordinates spread over every key (a parameter, its shape in `shapes`), so that a fault in any
        one of them moves some canaries: half of them in equal shares (FLOOR), the rest in proportion to each
        key's coordinates (or `allowed` ones: a flat bool mask per key), a key taking at most all it has. Within a key,
        among the `untouched` ones (a flat bool mask per key: the first step's real clipped sum was exactly 0 there)
        if it has enough of them, uniformly among its allowed ones otherwise."""
        room = {key: int(allowed[key].sum()) if allowed is not None else int(torch.Size(s).numel())
                for key, s in shapes.items()}
        if sum(room.values()) < self.m:
            raise ValueError(f"{self.m} canaries need as many coordinates; the method privatises "
                             f"{sum(room.values())} where they can live")
        total = sum(room.values())
        shares = {key: min(room[key], self.m // (FLOOR * len(room))) for key in room}
        half = self.m - sum(shares.values())
        for key in room:  # the rest in proportion to size (a large weight, e.g. a tied embedding, holds many)
            shares[key] += min(room[key] - shares[key], half * room[key] // total)
        for key in sorted(room, key=lambda key: shares[key] - room[key]):  # what rounding left, where there is room
            extra = min(self.m - sum(shares.values()), room[key] - shares[key])
            shares[key] += extra
        ids = torch.randperm(self.m, generator=self.gen).split([shares[key] for key in shapes])
        self.where, self.untouched = {}, untouched is not None
        for key, mine in zip(shapes, ids):
            if not len(mine):
                continue
            size = int(torch.Size(shapes[key]).numel())
            free = untouched[key] if untouched is not None else None
            if free is not None and allowed is not None:
                free = free & allowed[key]
            if free is not None and int(free.sum()) >= len(mine):
                pool = free.nonzero().flatten()
            else:
                self.untouched = False
                pool = allowed[key].nonzero().flatten() if allowed is not None else None
            count = len(pool) if pool is not None else size
            picks = (torch.randperm(count, generator=self.gen)[:len(mine)] if count <= 10**7
                     else self._distinct(count, len(mine)))
            self.where[key] = (mine, pool[picks] if pool is not None else picks)

    def groups(self) -> torch.Tensor | None:
        """The weight each canary lives in, as an index (the bound's guesses among one weight's canaries)."""
        if self.where is None:
            return None
        labels = torch.zeros(self.m, dtype=torch.long)
        for i, (ids, _) in enumerate(self.where.values()):
            labels[ids] = i
        return labels

    def _distinct(self, total: int, k: int) -> torch.Tensor:
        seen: dict[int, None] = {}
        while len(seen) < k:
            for j in torch.randint(total, (2 * k,), generator=self.gen).tolist():
                seen.setdefault(j, None)
        return torch.tensor(list(seen)[:k])

    def sample(self, rate: float) -> torch.Tensor:
        """This step's Poisson sample of the included canaries (the run's rate q, as for real examples)."""
        return self.included & (torch.rand(self.m, generator=self.gen) < rate)

    # -- first-order methods: planted into the clipped sums, scored on the released gradient ---------------------
    def on_clipped(self, privatizer, summed: dict) -> dict:
        self.plant(summed, privatizer.clipped_sum_of, privatizer.mechanism.sample_rate)
        return summed

    def on_noised(self, privatizer, released: dict) -> dict:
        noise = privatizer.mechanism
        self.sigma = noise.sigma
        scale = noise.expected_batch_size / noise.max_grad_norm
        if self.scored():
            self.record(released, scale, noise.expected_batch_size)
        self.record_tensors(released, scale)  # every step, the first too: the whole model's check counts them all
        return released

    def scored(self) -> bool:
        """Whether this step's release counts in the canaries' scores (it is in the whole model's check anyway)."""
        return self.where is not None

    def record_tensors(self, released: dict, scale: float) -> None:
        """Σ y² of every released tensor this step (y = released·scale = s + σz at every coordinate, s the clipped
        sum there, canaries' included): one float per tensor, on the device until the step's list is made."""
        with torch.no_grad():
            squares = torch.stack([_squares(v) for v in released.values()]) * scale ** 2
        self.step_squares.append(squares.cpu().tolist())
        if not self.tensor_sizes:
            self.tensor_sizes = [v.numel() for v in released.values()]
            self.tensor_keys = list(released)

    def plant(self, summed: dict, clipped_sum, rate: float) -> None:
        """Add the sampled canaries to `summed`, clipped and summed by `clipped_sum` (the Privatizer's own code for
        real samples: norm rule, clip factors, weighted sum) from their per-sample gradients, one Dirac each."""
        if self.where is None:
            small = sum(s.numel() for s in summed.values()) <= 10**8  # the masks are a byte per coordinate, on the host
            zero = {key: (s == 0).reshape(-1).cpu() for key, s in summed.items()} if small else None
            self.place({key: s.shape for key, s in summed.items()}, zero)
        self.background = self.at_canaries(summed)  # the real samples' clipped sum, before any canary joins it
        sampled = self.sample(rate)
        for key, (ids, flat) in self.where.items():
            hit = flat[sampled[ids]]
            if len(hit):  # each canary lives in one key: its norm there is its whole norm
                summed[key] += clipped_sum({key: self._diracs(summed[key], hit)})[key].to(summed[key].dtype)

    def at_canaries(self, summed: dict) -> dict:
        """`summed`'s values at the canaries' coordinates, by key (float64, on the host; 0 where a key is missing).
        Taken from the real samples' clipped sum, they come out of the canaries' scores (`record`): the white-box
        auditor sees that sum, and it does not depend on which canaries are in, so the bound stays valid and the
        scores lose the real gradients' background."""
        return {key: summed[key].reshape(-1)[flat.to(summed[key].device)].double().cpu() if key in summed
                else torch.zeros(len(flat), dtype=torch.float64) for key, (_, flat) in self.where.items()}

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

    def record(self, released: dict, scale: float | None = None, divisor: float = 1.0) -> None:
        """Add the step's released values at the canaries' coordinates, less the real samples' clipped sum there
        over `divisor` (q·n), to their scores; with `scale` (q·n/C), the left-out canaries' (the claimed noise
        alone, under the claim), in units of C/(q·n), to the noise check's squares."""
        for key, (ids, flat) in self.where.items():
            values = released[key].reshape(-1)[flat.to(released[key].device)].double().cpu()
            values -= self.background[key] / divisor
            self.scores[ids] += values
            if scale is not None:
                out = values[~self.included[ids]] * scale
                self.noise_count += len(out)
                self.noise_squares += float(out.square().sum())

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

    def record_scalar(self, released: float, clipped: torch.Tensor, max_grad_norm: float, added: float,
                      sigma: float) -> None:
        """DPZero's step: each canary's score gets the release times its clipped scalar (in units of C); the noise
        check gets `added`, the release less the clipped sum the mechanism was handed, in units of C (σ z under the
        claim: the check sees the noise itself, where the release's square, B clipped scalars beside σC, would say
        little about σ)."""
        self.scores += released * clipped / max_grad_norm
        self.sigma = sigma
        self.noise_count += 1
        self.noise_squares += added ** 2


SQUARES_CHUNK = 2**22  # elements summed in float64 at once: a float64 copy of a whole embedding would be 300 MB


def _squares(v: torch.Tensor) -> torch.Tensor:
    """Σ v² in float64 (float32's sum of 10⁷ squares is off by 1e-3, more than the check's resolution), a chunk at a
    time."""
    flat = v.reshape(-1)
    return sum(torch.linalg.vector_norm(flat[i:i + SQUARES_CHUNK], dtype=torch.float64).square()
               for i in range(0, flat.numel(), SQUARES_CHUNK))


FLOOR = 2  # a share of m / (FLOOR · keys) canaries for every key; the rest in proportion to size
HOSTS = (nn.Linear, nn.Embedding)  # layers whose weight a canary can be made through (exactly these types)


class BatchCanaries(GradientCanaries):
    """Gradient canaries that join the micro-batches as samples (`audit.plant=batch`): the Privatizer's observer.

    Placed at the first step's clipped sums (which hold no canary), spread over the weights of every trainable
    nn.Linear and nn.Embedding layer (`hosts`; `place` says how). From the second step on, the step's Poisson sample
    of the included canaries joins as a micro-batch of its own, after the real ones (on rank 0; `on_accumulated`
    reads the real clipped sum at the canaries' coordinates before it runs): each canary a copy of a real row, whose
    loss is replaced by Σ_u ⟨layer_u(x_u), G_u⟩ over `uses` calls of the host weight's
    layers (its owners in turn), each with a one-hot input and a one-hot output gradient of norm/uses at the
    canary's coordinate (for a Linear, two positions whose output gradients cancel in the bias). Its loss is 0; its
    per-sample gradient is norm·e_(i,j) on the host weight and 0 elsewhere, made by the layers' own hooks."""

    def __init__(self, m: int, norm: float, seed: int, uses: int = 16):
        super().__init__(m, norm, seed)
        if uses < 1:
            raise ConfigError("audit.uses", f"{uses}: need at least 1")
        self.uses = uses
        self.owners: dict[nn.Parameter, list[nn.Module]] = {}
        self.hosts: list[nn.Parameter] = []
        self.live = False  # canaries joined this step's micro-batches (the first step's place them)
        self._template: dict | None = None  # a row to copy when a step has no micro-batch
        self._rows: dict[int, tuple[int, torch.Tensor]] = {}  # id(joined micro-batch) -> (first canary row, ids)

    def attach(self, privatizer) -> None:
        if privatizer.plan.projected:
            raise ConfigError("audit.plant", "the method privatises projected gradients (grape): its canaries "
                              "live in the projection; use audit.plant=sum")
        if privatizer.sharded:
            raise ConfigError("audit.plant", "FSDP's layers cannot be called alone; use audit.plant=sum")
        trainable = {id(p) for p in privatizer.params}
        owners: dict[int, list[nn.Module]] = {}
        others: set[int] = set()
        for module in privatizer.model.modules():
            for name, q in module.named_parameters(recurse=False):
                if type(module) in HOSTS and name == "weight":
                    owners.setdefault(id(q), []).append(module)
                else:
                    others.add(id(q))
        self.owners = {m.weight: mods for mods in owners.values() for m in mods[:1]
                       if id(m.weight) in trainable and id(m.weight) not in others}
        if not self.owners:
            raise ConfigError("audit.plant", "no trainable nn.Linear or nn.Embedding weight to make canaries "
                              "through; use audit.plant=sum")

    def _allowed(self, p: nn.Parameter) -> torch.Tensor:
        """The coordinates of host weight `p` a canary can be made at (an embedding's padding row has no gradient)."""
        mask = torch.ones(p.shape, dtype=torch.bool)
        for module in self.owners[p]:
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                mask[module.padding_idx] = False
        return mask.reshape(-1)

    def on_microbatches(self, privatizer, microbatches, loss_fn):
        micro = list(microbatches)
        if self._template is None and micro and batch_size(micro[0]):
            self._template = {k: v[:1].clone() for k, v in micro[0].items()}
        self.live, self._rows, self._real = self.where is not None, {}, len(micro)
        self._local = None  # this rank's real clipped sum at the canaries' coordinates (`on_accumulated`)
        if not self.live:
            return micro, loss_fn
        sampled = self.sample(privatizer.mechanism.sample_rate).nonzero().flatten()
        if not len(sampled) or not distributed.is_main():  # one rank holds the canaries, as one holds a sample
            return micro, loss_fn
        # the canaries' own micro-batch, after the real ones: the real clipped sum is read before it joins
        own = self._join({k: v[:0].to(privatizer.device) for k, v in self._template.items()}, sampled,
                         privatizer.device)

        def with_canaries(model, batch):
            losses = loss_fn(model, batch)
            if id(batch) not in self._rows:
                return losses
            start, ids = self._rows[id(batch)]
            made = self._made(len(losses), start, ids, losses.device)
            rows = torch.arange(len(losses), device=losses.device) >= start
            return torch.where(rows, made - made.detach(), losses)  # a canary's loss is 0, its gradient the canary
        return [*micro, own], with_canaries

    def on_accumulated(self, privatizer, summed: dict, index: int) -> None:
        if self.live and index == self._real - 1:  # the last real micro-batch's: the canaries' comes next
            self._local = self.at_canaries(summed)

    def _join(self, mb: dict, ids: torch.Tensor, device) -> dict:
        if not len(ids):
            return mb
        n = batch_size(mb)
        row = {k: v[:1] for k, v in mb.items()} if n else {k: v.to(device) for k, v in self._template.items()}
        columns = {k: torch.cat([v, row[k].expand(len(ids), *row[k].shape[1:])]) for k, v in mb.items()}
        if isinstance(mb, Padded):
            out = Padded(columns, mb.real)
            out.weights = torch.cat([mb.weights, torch.ones(len(ids), device=mb.weights.device)])
        else:
            out = columns
        self._rows[id(out)] = (n, ids)
        return out

    def _made(self, batch: int, start: int, ids: torch.Tensor, device) -> torch.Tensor:
        """Each row's canary loss: 0 for the real rows, Σ_u ⟨layer_u(x_u), G_u⟩ for the canaries'."""
        total = torch.zeros(batch, device=device)
        for h, p in enumerate(self.hosts):
            mine = (self._host[ids] == h).nonzero().flatten()
            if not len(mine):
                continue
            rows = (start + mine).to(p.device)
            flat = self._flat[ids[mine]].to(p.device)
            i, j = flat // p.shape[1], flat % p.shape[1]
            owners = self.owners[p]
            for k, module in enumerate(owners):
                calls = len(range(k, self.uses, len(owners)))  # the uses spread over the owners in turn
                x, grad = self._use(module, batch, rows, i, j)
                for _ in range(calls):  # each call a use of its own, with its own output and hook
                    total = total + (module(x) * grad).sum((1, 2)).to(device)
        return total

    def _use(self, module: nn.Module, batch: int, rows, i, j) -> tuple[torch.Tensor, torch.Tensor]:
        """The input and output gradient of a call of `module` whose weight's per-sample gradient is
        (norm/uses)·e_(i,j) for `rows` and 0 for the others."""
        w, a = module.weight, self.norm / self.uses
        if isinstance(module, nn.Embedding):  # weight (vocab, dim): row i looked up, output gradient a·e_j
            ids = torch.zeros(batch, 1, dtype=torch.long, device=w.device)
            ids[rows, 0] = i
            grad = torch.zeros(batch, 1, w.shape[1], dtype=w.dtype, device=w.device)
            grad[rows, 0, j] = a
            return ids, grad
        x = torch.zeros(batch, 2, w.shape[1], dtype=w.dtype, device=w.device)  # weight (out, in): input e_j
        x[rows, 0, j] = 1
        grad = torch.zeros(batch, 2, w.shape[0], dtype=w.dtype, device=w.device)
        grad[rows, 0, i] = a  # output gradient a·e_i at the first position, -a·e_i at the second (input 0):
        grad[rows, 1, i] = -a  # the weight's gradient a·e_i e_jᵀ, the bias's a·e_i - a·e_i = 0
        return x, grad

    def on_clipped(self, privatizer, summed: dict) -> dict:
        if self.where is None:  # the first step's sums, which no canary joined: where the canaries live
            small = sum(p.numel() for p in self.owners) <= 10**8  # the masks are a byte per coordinate, on the host
            hosts = list(self.owners)
            untouched = {p: (summed[p] == 0).reshape(-1).cpu() for p in hosts} if small else None
            self.place({p: p.shape for p in hosts}, untouched, {p: self._allowed(p) for p in hosts})
            self.hosts = [p for p in hosts if p in self.where]
            self._host = torch.full((self.m,), -1, dtype=torch.long)
            self._flat = torch.zeros(self.m, dtype=torch.long)
            for h, p in enumerate(self.hosts):
                ids, flat = self.where[p]
                self._host[ids], self._flat[ids] = h, flat
        elif self.live:  # the real samples' clipped sum at the canaries' coordinates, over every rank
            local = self._local if self._local is not None else self.at_canaries({})
            keys = list(local)
            joined = torch.cat([local[key] for key in keys]).to(privatizer.device)
            distributed.sum_([joined])
            self.background = dict(zip(keys, joined.cpu().split([len(local[key]) for key in keys])))
        return summed

    def scored(self) -> bool:
        return self.live  # the first step's release: the canaries were placed from it, and none joined it


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
