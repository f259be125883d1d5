"""DPZero (Zhang et al. 2024) and MeZO (Malladi et al. 2023): zeroth-order training at inference memory
(baselines in DP-GRAPE (arXiv 2506.15588), which does not give DPZero's algorithm; details from DPZero's public
code). One step, with a fresh direction seed s:

    θ ← θ + λz ; L⁺ᵢ ;  θ ← θ − 2λz ; L⁻ᵢ ;  θ ← θ + λz          z = z(s), regenerated parameter by parameter
    gᵢ = (L⁺ᵢ − L⁻ᵢ) / (2λ)                                          one scalar per sample
    DPZero: g = ( Σᵢ clip(gᵢ, [−C, C]) + N(0, σ²C²) ) / (q·n)        MeZO: g = mean(gᵢ)
    θ ← θ − η·g·z

No backward pass and no stored activations: the forwards run under no_grad. The clipped quantity is a scalar,
so the Gaussian mechanism is one-dimensional and the same accountant as every other method applies.
"""

from __future__ import annotations

import torch

from dpmem import distributed
from dpmem.config import ConfigError, DPZeroConfig, ZerothOrderConfig, enum_value
from dpmem.data.bundle import real_size, weights
from dpmem.methods.base import Method, MethodSpec
from dpmem.methods.privatize import per_sample
from dpmem.privacy.mechanism import GaussianMechanism


NO_ULS = "clips each record's scalar (L⁺ − L⁻)/2λ, its two forwards run record by record, not user by user"


class ZerothOrder(Method):
    """MeZO; DPZero is the same step with per-sample clipping and noise."""

    config = ZerothOrderConfig
    spec = MethodSpec(compiled_step=True, zeroth_order=True, no_uls=NO_ULS)  # its forwards compiled (`compile`)

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        if not cfg.method.zo_eps > 0:  # the perturbation size lambda
            raise ConfigError("method.zo_eps", f"{cfg.method.zo_eps} must be > 0")

    def __init__(self, model, cfg, lr, mechanism: GaussianMechanism | None = None, seed: int = 0):
        super().__init__(model, cfg, lr, mechanism, seed)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.eps, self.direction = cfg.zo_eps, enum_value(cfg.direction)
        self.device = self.params[0].device
        self.seeds = torch.Generator().manual_seed(seed)  # direction seeds, reproducible from the run seed
        self.dim = sum(p.numel() for p in self.params)
        # dpmem audit's GradientCanaries (DPZero): scalars along the step's direction, clipped with the real ones
        if len(self.observers) > 1:
            raise ValueError(f"{cfg.name} takes one observer, dpmem audit's canaries; given {len(self.observers)}")
        self.canaries = self.observers[0] if self.observers else None

    def state_dict(self) -> dict:
        return {**super().state_dict(), "direction_rng": self.seeds.get_state()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.seeds.set_state(state["direction_rng"].cpu())  # a CPU generator (host-side seeds)

    def _directions(self, seed: int):
        """z for each parameter in turn, regenerated from `seed` (only one parameter's z exists at a time)."""
        gen = None if self.device.type == "meta" else torch.Generator(device=self.device).manual_seed(seed)
        scale = None
        if self.direction == "sphere":  # uniform on the sphere of radius √d, so that E[zzᵀ] = I as for Gaussian z
            squares = sum(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).pow(2).sum()
                          for p in self.params)
            scale = (self.dim / squares).sqrt()
            if gen is not None:
                gen.manual_seed(seed)
        for p in self.params:
            z = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            yield p, (z if scale is None else z * scale).to(p.dtype)

    @torch.no_grad()
    def _perturb(self, seed: int, alpha) -> None:
        for p, z in self._directions(seed):
            p.add_(z * alpha)

    def compile(self, compiler) -> None:
        """The forward passes compiled (the perturbations, drawn from a generator, stay eager)."""
        forward = compiler(self._forward, "forward")
        # under CUDA graphs each call's losses are overwritten by the next: copied out before the next call
        self._forward = (lambda mb, loss_fn: forward(mb, loss_fn).clone()) if compiler.reuses_outputs else forward

    def _forward(self, mb, loss_fn) -> torch.Tensor:
        # a padding sample weighs 0: its estimate and loss are 0, and clipping keeps them 0
        return per_sample(loss_fn(self.model, mb), mb).float() * weights(mb)

    @torch.no_grad()
    def _losses(self, microbatches, loss_fn) -> torch.Tensor:
        return torch.cat([self._forward(mb, loss_fn) for mb in microbatches])

    def per_sample_estimates(self, seed: int, microbatches, loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
        """(gᵢ, mean of L⁺ᵢ and L⁻ᵢ) for the direction of `seed`; the parameters end where they started. Both
        passes draw the same random numbers, so that active dropout (the model's, LoRA's) takes the same masks
        and L⁺, L⁻ are one function at two points; otherwise their difference over 2λ is the masks' noise."""
        self._perturb(seed, self.eps)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            plus = self._losses(microbatches, loss_fn)
        self._perturb(seed, -2 * self.eps)
        minus = self._losses(microbatches, loss_fn)
        self._perturb(seed, self.eps)
        return (plus - minus) / (2 * self.eps), (plus + minus) / 2

    def aggregate(self, estimates: torch.Tensor, count: int) -> torch.Tensor:
        """The mean over the logical batch (under torchrun: of every rank's estimates); `count` of them are real
        samples', the rest padding's zeros."""
        total = torch.stack([estimates.sum(), torch.tensor(float(count), device=estimates.device)])
        distributed.sum_([total])
        return total[0] / total[1]

    def step(self, microbatches, loss_fn):
        seed = int(torch.randint(2**62, (1,), generator=self.seeds))  # host-side RNG, no device sync
        if not microbatches:
            estimates, loss = torch.zeros(0, device=self.device), torch.zeros((), device=self.device)
        else:
            estimates, mid = self.per_sample_estimates(seed, microbatches, loss_fn)
            loss = (self.mechanism.clipped_losses(mid) if self.mechanism is not None else mid).sum()
        count = sum(real_size(mb) for mb in microbatches)
        if self.canaries is None:
            g = self.aggregate(estimates, count)
        else:  # a canary's scalar is its gradient along this step's direction, clipped with the real ones
            along = self.canaries.directional(self._directions(seed))
            planted = along[self.canaries.sample(self.mechanism)].to(estimates.device, estimates.dtype)
            total = self.clipped_sum(torch.cat([estimates, planted]))
            g = self.mechanism.release({None: total.clone()})[None]  # `total` kept: the noise check reads it
            C = self.mechanism.max_grad_norm
            # the noise check's value: what the release added to the clipped sum it was handed, in units of C
            added = (float(g) * self.mechanism.expected_batch_size - float(total)) / C
            self.canaries.record_scalar(float(g), along.clamp(-C, C), C, added, self.mechanism.sigma)
        self._perturb(seed, -self.lr * g)
        return loss if self.mechanism is None else self.mechanism.released_loss(loss)


class MeZO(ZerothOrder):
    def step(self, microbatches, loss_fn):
        if not distributed.total(sum(real_size(mb) for mb in microbatches)):
            return torch.zeros((), device=self.device)  # nothing sampled: no estimate, no update
        return super().step(microbatches, loss_fn)


class DPZero(ZerothOrder):
    config = DPZeroConfig
    spec = MethodSpec(private=True, compiled_step=True, zeroth_order=True, no_uls=NO_ULS)

    def clipped_sum(self, estimates: torch.Tensor) -> torch.Tensor:
        """The logical batch's sum of scalars clipped to [-C, C] (over every rank: each adds the same noise draw)."""
        C = self.mechanism.max_grad_norm
        total = estimates.clamp(-C, C).sum()
        distributed.sum_([total])
        return total

    def aggregate(self, estimates: torch.Tensor, count: int | None = None) -> torch.Tensor:
        # `count` is not needed: the clipped sum is divided by the expected batch size
        # a scalar's release: under key None (a broken mechanism's `noise_std(None)`), one draw on every rank
        return self.mechanism.release({None: self.clipped_sum(estimates)})[None]
