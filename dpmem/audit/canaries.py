"""The canaries of `dpmem audit` (docs/privacy.md, "Auditing", says what each kind sees and catches). Input canaries
(black-box) are mislabelled training examples. Gradient canaries: white-box one-run auditing (Steinke, Nasr,
Jagielski 2023, §6's gradient-space canaries), each a Dirac vector of norm `norm` (a multiple of C, so that the
method's clipping has work to do) at one coordinate of the quantity the method privatises: a parameter's gradient;
grape's projected r-dimensional gradient Pᵀ G (the gradient Pᵀ-lifted from that Dirac is what the projection maps
onto it); for dpzero, seen through the step's direction as ⟨c, z⟩. A canary's score is the sum over steps of the
released value at its coordinate (the auditor who sees every privatised gradient: the threat model DP-SGD's
accounting assumes) less the real samples' clipped sum there, which that auditor sees too and which does not depend
on which canaries are in, so the bound stays valid. They join the step in the sum (`GradientCanaries.on_clipped`) or
in the batch (`BatchCanaries`)."""

from __future__ import annotations

import torch
from torch import nn

from dpmem import distributed
from dpmem.config import ConfigError
from dpmem.methods.base import batch_size
from dpmem.methods.privatize import Observer
from dpmem.privacy.accounting import group_rate
from dpmem.privacy.correlated import CorrelatedNoise
from dpmem.privacy.record import PrivacyUnit
from dpmem.privacy.strategies import Strategy


class GradientCanaries(Observer):
    """The Privatizer's observer (planted in the clipped sums, scored on the release), or DPZero's (its scalars)."""

    live = True  # this step's release counts in the scores (the noise checks count every release)

    def __init__(self, m: int, norm: float, seed: int):
        self.m, self.norm = m, norm
        self.gen = torch.Generator().manual_seed(seed)
        self.included = torch.rand(m, generator=self.gen) < 0.5  # the secret bits
        self.group: torch.Tensor | None = None  # under cyclic sampling, each canary's group (`sample`)
        self.scores = torch.zeros(m, dtype=torch.float64)
        self.where: dict | None = None  # key -> (canary ids, flat indices), placed at the first step
        self.untouched = False  # every canary placed where the first step's real gradients were zero
        self.background: dict | None = None  # the step's real clipped sum at the canaries' coordinates (by key)
        # the noise at the left-out canaries' coordinates (the release less the real samples' clipped sum), in units
        # of C/(q·n), un-correlated by the claimed strategy (`follow`): its values a step, their count and squares,
        # and each step's cosines with the last steps' (`bound.correlation_check`)
        self.sigma, self.noise_dim, self.noise_count, self.noise_squares = None, 0, 0, 0.0
        self.noise_cosines: list[list[float]] = []
        self._noise_whitening, self._recent = None, []  # the last steps' noise vectors, newest first
        # Σ u² of every released tensor at every step, u the release un-correlated the same way, in the same units
        # (steps × tensors), its size and key; Σ (u_t − u_{t−1})² over all of them, a step from the second on
        self.step_squares, self.tensor_sizes, self.tensor_keys, self.step_differences = [], [], [], []
        self._release_whitening, self._last = None, None

    def place(self, shapes: dict, first: dict | None = None, allowed: dict | None = None) -> None:
        """m distinct coordinates spread over every key (a parameter, its shape in `shapes`), so that a fault in any
        one of them moves some canaries: half of them in equal shares (FLOOR), the rest in proportion to each
        key's coordinates (or `allowed` ones: a flat bool mask per key), a key taking at most all it has. Within a key,
        among those where the first step's real clipped sum (`first[key]`) is exactly 0 if it has enough of them
        (unused tokens' embedding rows, weights of always-zero inputs), uniformly among its allowed ones otherwise:
        a choice by the real data alone, not by which canaries are in, so the bound stays valid."""
        sizes = {key: int(torch.Size(s).numel()) for key, s in shapes.items()}
        room = {key: int(allowed[key].sum()) if allowed is not None else sizes[key] for key in shapes}
        total = sum(room.values())
        if total < self.m:
            raise ValueError(f"{self.m} canaries need as many coordinates; the method privatises {total} where "
                             "they can live")
        shares = {key: min(room[key], self.m // (FLOOR * len(room))) for key in room}
        half = self.m - sum(shares.values())
        for key in room:  # the rest in proportion to size (a large weight, e.g. a tied embedding, holds many)
            shares[key] += min(room[key] - shares[key], half * room[key] // total)
        for key in sorted(room, key=lambda key: shares[key] - room[key]):  # what rounding left, where there is room
            shares[key] += min(self.m - sum(shares.values()), room[key] - shares[key])
        ids = torch.randperm(self.m, generator=self.gen).split([shares[key] for key in shapes])
        zeros = first is not None and sum(sizes.values()) <= 10**8  # the masks are a byte per coordinate, on the host
        self.where, self.untouched = {}, zeros
        for key, mine in zip(shapes, ids):
            if not len(mine):
                continue
            mask = allowed[key] if allowed is not None else None  # None: every coordinate
            if zeros:
                free = (first[key] == 0).reshape(-1).cpu()
                free = free & mask if mask is not None else free
            if zeros and int(free.sum()) >= len(mine):
                mask = free
            else:
                self.untouched = False
            pool = mask.nonzero().flatten() if mask is not None else None
            count = len(pool) if pool is not None else sizes[key]
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

    def records(self, mechanism) -> torch.Tensor:
        """How many records of each canary join this step: a canary is a record (`sample`), or under privacy.unit=user
        a user of k records (privacy.records_per_user), each a gradient `norm` at the canary's coordinate: ULS
        samples the user at its rate and takes all k; ELS samples each record alone at the records' rate."""
        unit = PrivacyUnit.in_summary(mechanism.summary)
        if not unit.user:
            return self.sample(mechanism).long()
        k = unit.k
        if unit.uls:
            return self.sample(mechanism).long() * k
        drawn = torch.rand(self.m, k, generator=self.gen) < mechanism.sample_rate
        return self.included.long() * drawn.sum(1)

    def sample(self, mechanism) -> torch.Tensor:
        """This step's sample of the included canaries, as the run samples its records: Poisson at its rate q, or
        under cyclic sampling (correlated noise) each canary in a group of its own, drawn once, joining its group's
        steps alone at the group's rate, which is what the accountant assumes of a record."""
        groups = mechanism.groups
        if not groups:
            return self.included & (torch.rand(self.m, generator=self.gen) < mechanism.sample_rate)
        if self.group is None:
            self.group = torch.randint(groups, (self.m,), generator=self.gen)
        rate = group_rate(mechanism.sample_rate, mechanism.event.dataset_size, groups)
        turn = self.group == mechanism.releases % groups  # releases so far: this step's index
        return self.included & turn & (torch.rand(self.m, generator=self.gen) < rate)

    # -- first-order methods: planted into the clipped sums, scored on the released gradient ---------------------
    def on_clipped(self, privatizer, summed: dict) -> dict:
        """Add this step's sampled canaries to `summed`: their per-sample gradients, one Dirac each, clipped and summed
        by the Privatizer's `clipped_sum_of` (its code for real samples: norm rule, clip factors, weighted sum)."""
        if self.where is None:
            self.place({key: s.shape for key, s in summed.items()}, summed)
        self.background = self.at_canaries(summed)  # the real samples' clipped sum, before any canary joins it
        mechanism = privatizer.mechanism
        joined = self.records(mechanism)  # records a canary brings (a user's under privacy.unit=user)
        uls = PrivacyUnit.in_summary(mechanism.summary).uls
        for key, (ids, flat) in self.where.items():
            hit = flat.repeat_interleave(joined[ids])  # a canary's records side by side (ULS: a user's k)
            if len(hit):  # each canary lives in one key: its norm there is its whole norm
                diracs = self._diracs(summed[key], hit)
                planted = privatizer.clipped_sum_of({key: diracs}, int(mechanism.summary["records_per_user"])
                                                    if uls else None)[key]
                summed[key] += planted.to(summed[key].dtype)
        return summed

    def follow(self, mechanism) -> None:
        """The claimed noise's strategy (`mechanism.strategy`, restarting at `mechanism.restart`), which the noise
        checks un-correlate the releases by: once, before the first release's values are recorded (`run_audit` for
        DPZero's scalars, whose step does not hand the canaries its mechanism; the first `on_noised` otherwise)."""
        if self._noise_whitening is None:
            self._noise_whitening = Whitening(mechanism.strategy, mechanism.restart)
            self._release_whitening = Whitening(mechanism.strategy, mechanism.restart)

    def on_noised(self, privatizer, released: dict) -> dict:
        """A canary's score gets the release at its coordinate less `background` over q·n; the noise checks, the
        left-out canaries' such values in units of C/(q·n) (the claimed noise alone, under the claim), and every
        released tensor's squares (`bound.whole_noise_check`), the first step's too."""
        noise = privatizer.mechanism
        self.follow(noise)
        self.sigma, n = noise.sigma, noise.expected_batch_size
        scale = n / noise.max_grad_norm
        out = []
        for key, values in self.at_canaries(released).items():
            ids = self.where[key][0]
            values -= self.background[key] / n
            if self.live:
                self.scores[ids] += values
            out.append(values[~self.included[ids]] * scale)
        self._record_noise(torch.cat(out))
        u = self._release_whitening(released)
        with torch.no_grad():  # a float per tensor, and one for the step's difference from the last
            self.step_squares.append((torch.stack([_squares(v) for v in u.values()]) * scale ** 2).cpu().tolist())
            if self._last is not None:
                change = sum(_squares(v, self._last[key]) for key, v in u.items())
                self.step_differences.append(float(change) * scale ** 2)
        # the release itself (independent noise) becomes the gradient, which the optimiser may change: a copy
        self._last = {key: v.clone() if v is released[key] else v for key, v in u.items()}
        if not self.tensor_sizes:
            self.tensor_sizes, self.tensor_keys = [v.numel() for v in released.values()], list(released)
        return released

    def _record_noise(self, values: torch.Tensor) -> None:
        """One step's noise values (float64, on the host), un-correlated: their squares, and their cosines with the
        last steps' (as many as the strategy's bands; 0 where either is all zeros)."""
        z = self._noise_whitening({"noise": values})["noise"]
        self.noise_dim = len(z)
        self.noise_count += len(z)
        self.noise_squares += float(z.square().sum())
        norm = float(torch.linalg.vector_norm(z))
        self.noise_cosines.append([float(z @ old) / (norm * float(torch.linalg.vector_norm(old)) or 1.0)
                                   for old in self._recent])
        self._recent = [z, *self._recent][:self._noise_whitening.bands]

    def at_canaries(self, summed: dict) -> dict:
        """`summed`'s values at the canaries' coordinates, by key (float64, on the host; 0 where a key is missing):
        the real samples' clipped sum there, which comes out of the canaries' scores (`on_noised`)."""
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

    # -- zeroth-order: seen through the direction --------------------------------------------------------------
    def directional(self, directions) -> torch.Tensor:
        """⟨cᵢ, z⟩ for every canary, from `directions` = [(parameter, z)] of this step (placed at the first)."""
        directions = dict(directions)
        if self.where is None:
            self.place({p: p.shape for p in directions})
        values = torch.zeros(self.m, dtype=torch.float64)
        for p, at in self.at_canaries(directions).items():
            values[self.where[p][0]] = self.norm * at
        return values

    def record_scalar(self, released: float, clipped: torch.Tensor, max_grad_norm: float, added: float,
                      sigma: float) -> None:
        """DPZero's step: each canary's score gets the release times its clipped scalar (in units of C); the noise
        check gets `added`, the release less the clipped sum the mechanism was handed, in units of C: σz under the
        claim, the noise itself (the release's square, B clipped scalars beside σC, would say little about σ)."""
        self.scores += released * clipped / max_grad_norm
        self.sigma = sigma
        if self._noise_whitening is None:
            raise RuntimeError("DPZero's canaries un-correlate its noise by the claimed strategy: follow(mechanism) "
                               "before the first step (run_audit does)")
        self._record_noise(torch.tensor([added], dtype=torch.float64))


SQUARES_CHUNK = 2**22  # elements summed in float64 at once: a float64 copy of a whole embedding would be 300 MB


def _squares(v: torch.Tensor, less: torch.Tensor | None = None) -> torch.Tensor:
    """Σ (v − less)² (Σ v² without `less`) in float64, a chunk at a time (float32's sum of 10⁷ squares errs by 1e-3,
    above the check's resolution; a whole difference would be another copy of the gradient)."""
    flat, other = v.reshape(-1), less.reshape(-1) if less is not None else None
    return sum(torch.linalg.vector_norm(flat[i:i + SQUARES_CHUNK] if other is None
                                        else flat[i:i + SQUARES_CHUNK] - other[i:i + SQUARES_CHUNK],
                                        dtype=torch.float64).square()
               for i in range(0, flat.numel(), SQUARES_CHUNK))


class Whitening:
    """u = C y over the releases, coordinate by coordinate, C the claimed strategy's (`dpmem.privacy.strategies`),
    block-diagonal where its correlation restarts (`CorrelatedNoise.block_start`, the claim's own): the claimed noise
    σC⁻¹z becomes σz, standard normal and fresh each step, which the noise checks test. bandmf (C banded, c its b
    coefficients): u_i = Σ_{j<b} c_j y_{i−j}, its last b − 1 inputs kept; bisr (C⁻¹ banded, d): u_i = (y_i −
    Σ_{0<j<p} d_j u_{i−j}) / d_0, its last p − 1 outputs kept; independent noise: u = y, nothing kept. Called once
    per release, in order, with a dict of tensors (the same keys each time); what it returns it may keep: read-only."""

    def __init__(self, strategy: Strategy | None, restart: int | None):
        correlated = strategy is not None and strategy.name != "independent"
        self.coefs = strategy.coefs if correlated else (1.0,)
        self.recursive = correlated and strategy.name == "bisr"
        self.bands = len(self.coefs)  # the lags the noise checks test: up to the strategy's bands, 1 for independent
        self.blocks = CorrelatedNoise(strategy, None, restart) if correlated else None
        self.index, self.kept = 0, {}

    def __call__(self, values: dict) -> dict:
        i, self.index = self.index, self.index + 1
        if self.blocks is None:
            return values
        if self.blocks.block_start(i) == i:
            self.kept.clear()
        out = {}
        for key, y in values.items():
            kept = self.kept.get(key, [])
            wide = torch.promote_types(y.dtype, torch.float32)  # bisr's recursion in bfloat16 would drift
            if self.recursive:
                u = y.to(wide, copy=True)
                for d, old in zip(self.coefs[1:], kept):
                    u.sub_(old, alpha=d)
                u.div_(self.coefs[0])
                newest = u
            else:
                u = y.to(wide) * self.coefs[0]
                for c, old in zip(self.coefs[1:], kept):
                    u.add_(old, alpha=c)
                newest = y.to(wide, copy=True)
            self.kept[key] = [newest, *kept][:self.bands - 1]
            out[key] = u
        return out


FLOOR = 2  # a share of m / (FLOOR · keys) canaries for every key; the rest in proportion to size
HOSTS = (nn.Linear, nn.Embedding)  # layers whose weight a canary can be made through (exactly these types)


def host_weights(model: nn.Module, trainable: set) -> dict[nn.Parameter, list[nn.Module]]:
    """The `trainable` weights batch canaries can be made through, each with its HOSTS layers (a weight any other
    layer uses too is left out)."""
    owners: dict[nn.Parameter, list[nn.Module]] = {}
    others: set[nn.Parameter] = set()
    for module in model.modules():
        for name, q in module.named_parameters(recurse=False):
            if type(module) in HOSTS and name == "weight":
                owners.setdefault(q, []).append(module)
            else:
                others.add(q)
    return {p: mods for p, mods in owners.items() if p in trainable and p not in others}


def allowed(p: nn.Parameter, owners: list[nn.Module]) -> torch.Tensor:
    """The coordinates of host weight `p` a canary can be made at (an embedding's padding row has no gradient)."""
    mask = torch.ones(p.shape, dtype=torch.bool)
    for module in owners:
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            mask[module.padding_idx] = False
    return mask.reshape(-1)


class BatchCanaries(GradientCanaries):
    """Gradient canaries that join the micro-batches as samples (`audit.plant=batch`; docs/privacy.md says what they
    see): the Privatizer's observer. From the second step on, the step's sampled canaries join as a micro-batch of
    their own after the real ones, on rank 0 (`on_accumulated` reads the real clipped sum at their coordinates before
    it runs). A canary's loss is 0; its per-sample gradient, norm·e_(i,j) on its host weight, is made by the layers'
    own hooks (`_made`)."""

    def __init__(self, m: int, norm: float, seed: int, uses: int = 16):
        super().__init__(m, norm, seed)
        self.uses = uses
        self.owners: dict[nn.Parameter, list[nn.Module]] = {}
        self.live = False  # canaries joined this step's micro-batches (the first step's place them)
        self._template: dict | None = None  # a real row, which the canaries' rows copy

    def attach(self, privatizer) -> None:
        """The host weights and their layers. `dpmem.audit.planting` refuses these cases first; refused here too,
        where the privatizer's facts are known (a canary built by hand)."""
        if privatizer.plan.projected:
            raise ConfigError("audit.plant", "the method privatises projected gradients (grape): its canaries "
                              "live in the projection; use audit.plant=sum")
        if privatizer.sharded:
            raise ConfigError("audit.plant", "FSDP's layers cannot be called alone; use audit.plant=sum")
        self.owners = host_weights(privatizer.model, set(privatizer.params))
        if not self.owners:
            raise ConfigError("audit.plant", "no trainable nn.Linear or nn.Embedding weight to make canaries "
                              "through; use audit.plant=sum")

    def _allowed(self, p: nn.Parameter) -> torch.Tensor:
        return allowed(p, self.owners[p])

    def on_microbatches(self, privatizer, microbatches, loss_fn):
        micro = list(microbatches)
        if self._template is None and micro and batch_size(micro[0]):
            self._template = {k: v[:1].clone() for k, v in micro[0].items()}
        self.live, self._real = self.where is not None, len(micro)
        self._local = None  # this rank's real clipped sum at the canaries' coordinates (`on_accumulated`)
        if not self.live:
            return micro, loss_fn
        sampled = self.sample(privatizer.mechanism)
        count = int(sampled.sum())
        if not count or not distributed.is_main():  # one rank holds the canaries, as one holds a sample
            return micro, loss_fn
        # the canaries' own micro-batch: a copy of the template row per sampled canary
        own = {k: v.to(privatizer.device).expand(count, *v.shape[1:]).contiguous() for k, v in self._template.items()}

        def with_canaries(model, batch):
            losses = loss_fn(model, batch)
            if batch is not own:
                return losses
            made = self._made(len(losses), sampled, losses.device)
            # a canary's loss is 0, its gradient the canary; the model's losses stay in the graph, with gradient 0
            return torch.where(torch.ones_like(losses, dtype=torch.bool), made - made.detach(), losses)
        return [*micro, own], with_canaries

    def on_accumulated(self, privatizer, summed: dict, index: int) -> None:
        if self.live and index == self._real - 1:  # the last real micro-batch's: the canaries' comes next
            self._local = self.at_canaries(summed)

    def _made(self, batch: int, sampled: torch.Tensor, device) -> torch.Tensor:
        """Each row's canary loss, Σ_u ⟨layer_u(x_u), G_u⟩: a row per `sampled` canary (a bool mask), in order."""
        total = torch.zeros(batch, device=device)
        row = sampled.cumsum(0) - 1  # a sampled canary's row
        for p, (ids, flat) in self.where.items():
            hit = sampled[ids]
            if not hit.any():
                continue
            rows, flat = row[ids[hit]].to(p.device), flat[hit].to(p.device)
            i, j = flat // p.shape[1], flat % p.shape[1]
            owners = self.owners[p]
            for k, module in enumerate(owners):  # the uses spread over the owners in turn
                x, grad = self._use(module, batch, rows, i, j)
                for _ in range(k, self.uses, len(owners)):  # each call a use of its own, with its own output and hook
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
            self.place({p: p.shape for p in self.owners}, summed, {p: self._allowed(p) for p in self.owners})
            self.background = self.at_canaries(summed)  # the noise checks' first values (no score this step)
        elif self.live:  # the real samples' clipped sum at the canaries' coordinates, over every rank
            local = self._local if self._local is not None else self.at_canaries({})
            joined = torch.cat(list(local.values())).to(privatizer.device)
            distributed.sum_([joined])
            self.background = dict(zip(local, joined.cpu().split([len(v) for v in local.values()])))
        return summed


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
        data.train = {k: torch.cat([v[rest], self.examples[k][self.included]]) for k, v in data.train.items()}
        return data

    @torch.no_grad()
    def score(self, parts, batch: int) -> None:
        """Minus the trained model's loss on each canary (with its wrong label), `batch` at a time."""
        parts.model.eval()
        losses = []
        for i in range(0, self.m, batch):
            mb = {k: v.to(parts.device) for k, v in parts.data.batch(self.examples, slice(i, i + batch)).items()}
            with parts.autocast():
                losses.append(parts.per_sample_loss(parts.model, mb).double().cpu())
        self.scores = -torch.cat(losses)
