"""The privacy ledger of one run: δ, σ calibrated before training, ε spent after t steps, and the summary's
privacy fields. An infinite ε (no privacy: a non-private method, privacy=none, a leaking subspace) is math.inf
here and "inf" in summary.json and metrics.jsonl (JSON has no infinity; `float("inf")` reads it back)."""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from dpmem import distributed
from dpmem.config import ConfigError, enum_value, resolve_delta
from dpmem.methods import method_class
from dpmem.methods.base import MethodSpec
from dpmem.methods.rc import check_probes, max_layer_dimension, rc_dimension
from dpmem.privacy import UnreachableTarget, calibrate_sigma, epsilon_spent
from dpmem.privacy.accounting import joint_sigma
from dpmem.privacy.mechanism import GaussianMechanism
from dpmem.privacy.randomness import Draws, key_of, os_key, seed_key


def line_epsilon(line: dict) -> float | None:
    """ε recomputed from what a privacy.jsonl line says it was computed from (σ accounted per step, q, δ, steps,
    the accountant): what a damaged or edited ε field cannot lower. None where the line cannot say (rc, whose
    envelope the line does not hold, or a field missing)."""
    try:
        if line.get("accountant") not in ("pld", "rdp") or not line.get("steps_done"):
            return None
        sigma = float(line.get("sigma_accounted") or line["sigma"])
        return epsilon_spent(sigma, float(line["delta"]), float(line["sample_rate"]), int(line["steps_done"]),
                             line["accountant"], line.get("neighbouring") or "add_remove",
                             line.get("sampling") or "poisson", line.get("dataset_size"))
    except (KeyError, TypeError, ValueError):
        return None


def resolve_accountant(cfg) -> str:
    """privacy.accountant, or for auto the one the method names (pld; rc for randomized clipping)."""
    accountant = enum_value(cfg.privacy.accountant)
    return method_class(cfg.method.name).spec.accountant if accountant == "auto" else accountant


class PrivacyLedger:
    def __init__(self, cfg, spec: MethodSpec, model: nn.Module, n: int, steps: int, sampling: str):
        p, m = cfg.privacy, cfg.method
        self.private = spec.private
        self.accounted = self.private and p.epsilon is not None  # privacy=none: a private method clips only
        # a budget given to a non-private method buys nothing: said once, and kept in the summary, so that a sweep
        # over privacy=eps2,eps8 with method=adam is seen to have run adam twice
        self.ignored = (f"privacy.epsilon={p.epsilon:g} has no effect: {m.name} is not private"
                        if not self.private and p.epsilon is not None else None)
        if self.ignored and distributed.is_main():
            print(f"dpmem: warning: {self.ignored}", file=sys.stderr)
        self.sample_rate = cfg.train.batch_size / n
        self.expected_batch_size = self.sample_rate * n
        self.delta = resolve_delta(p.delta, n) if self.accounted else None
        if self.accounted and self.delta * n >= 1:
            print(f"dpmem: warning: delta = {self.delta:.3g} is at least 1/n = {1 / n:.3g}: at that delta a mechanism "
                  "that publishes one random training record whole is still (epsilon, delta)-DP; the default "
                  "privacy.delta=auto is min(1e-5, 1/n^1.1)", file=sys.stderr)
        # the training loss: released with the gradient, in ε (loss_noise), outside it, or not at all
        # a non-private run's loss is exact, or none where privacy.train_loss=none asks for no loss at all
        self.loss_release = (enum_value(p.train_loss) if self.accounted
                             else "none" if enum_value(p.train_loss) == "none" else "exact")
        self.loss_bound = p.loss_bound if self.loss_release == "private" else math.inf
        self.accountant = dict(accountant=resolve_accountant(cfg), neighbouring=enum_value(p.neighbouring),
                               sampling=sampling, dataset_size=n,
                               loss_noise=p.loss_noise if self.loss_release == "private" else None)
        rc = None
        if self.accountant["accountant"] == "rc":  # the envelope of randomized clipping depends on the model
            if self.accounted and self.sample_rate >= 1:
                raise ConfigError("train.batch_size", f"{cfg.train.batch_size} samples every record at every step "
                                  f"(sampling rate {self.sample_rate:g}): the rc accountant needs a rate below 1 "
                                  "(a logical batch smaller than the training set)")
            check_probes(model, m.k)  # a run's k (a test may build the method with more, to near exact clipping)
            try:
                d, d_max_layer = rc_dimension(model, p.rc_dimension), max_layer_dimension(model)
            except ValueError as e:
                raise ConfigError("method.name", f"{m.name}: {e}") from None
            self.accountant.update(k=m.k, d=d, estimator=enum_value(m.estimator))
            # d inf is the whole-model envelope (dpmem.methods.rc.rc_dimension), d_max_layer the DP-SGD-RC paper's
            # max over layers of min(p, d), for comparison
            rc = {"k": m.k, "d": d, "d_max_layer": d_max_layer, "estimator": enum_value(m.estimator)}
        self.sigma = 0.0
        if self.accounted:  # under torchrun rank 0 calibrates, and every rank takes its σ (or its error)
            sigma = None
            if distributed.is_main():
                try:
                    sigma = calibrate_sigma(p.epsilon, self.delta, self.sample_rate, steps, **self.accountant)
                except UnreachableTarget as e:
                    sigma = str(e)
            sigma = distributed.from_main(sigma)
            if isinstance(sigma, str):
                raise ConfigError("privacy.epsilon", sigma)
            self.sigma = sigma
        # what an adversary holding config.yaml can replay: ε does not hold against one
        derivable = [what for what, seed in (("batches", p.sampler_seed), ("noise", p.noise_seed)) if seed is not None]
        if self.accounted and derivable and distributed.is_main():
            print(f"dpmem: warning: privacy.{'sampler' if 'batches' in derivable else 'noise'}_seed is set: the run's "
                  f"{' and '.join(derivable)} can be derived from its config, and epsilon does not hold against "
                  "anyone who has it (for debugging and tests)", file=sys.stderr)
        self.leak: str | None = None  # why a private run is not private after all (a subspace from its own data)
        self.released = 0.0  # the most ε an earlier attempt of this run recorded (privacy.jsonl): already spent
        self.fields = {
            "private": self.private, "epsilon_target": p.epsilon if self.accounted else None,
            "privacy_ignored": self.ignored, "derivable_from_config": derivable if self.accounted else None,
            "epsilon_spent": 0.0 if self.accounted else math.inf, "delta": self.delta,
            "delta_times_n": self.delta * n if self.accounted else None,
            "sigma": self.sigma if self.private else None,
            # the multiplier dp-accounting composes per step: the gradient's and the loss's releases as one
            "sigma_accounted": (joint_sigma(self.sigma, self.accountant["loss_noise"])
                                if self.accounted and self.accountant["accountant"] != "rc" else None),
            "train_loss_release": self.loss_release if self.accounted else None,
            "loss_bound": p.loss_bound if self.loss_release == "private" else None,
            "loss_sigma": self.sigma * p.loss_noise if self.loss_release == "private" else None,
            "max_grad_norm": m.max_grad_norm if self.private else None,
            "sample_rate": self.sample_rate, "sampling": sampling,
            "accountant": self.accountant["accountant"] if self.accounted else None,
            "neighbouring": self.accountant["neighbouring"] if self.accounted else None,
            "clipping": plan.name if (plan := spec.clipping(m)) is not None else None, "rc_accountant": rc,
        }

    def sampler_key(self, seed: int | None, train_seed: int) -> bytes:
        """The key of the batch sampler's draws: from `seed` if given; for an accounted run, from the OS (rank 0's,
        on every rank), since ε assumes nobody knows which steps held a record; otherwise from the run seed (a
        baseline's batches reproduce)."""
        if seed is not None or not self.accounted:
            return seed_key(seed if seed is not None else train_seed)
        return os_key()

    def mechanism(self, max_grad_norm: float, seed: int | None, device: torch.device) -> GaussianMechanism:
        """The Gaussian mechanism of a private method; its draws keyed from the OS unless `seed` is given. Under
        torchrun every rank gets rank 0's key: each adds the same draw to the same all-reduced sum."""
        draws = None if device.type == "meta" else Draws(key_of(seed), "noise", device)
        return GaussianMechanism(self.sigma, max_grad_norm, expected_batch_size=self.expected_batch_size, draws=draws,
                     sample_rate=self.sample_rate, loss_bound=self.loss_bound,
                     loss_sigma=self.fields["loss_sigma"] or 0.0)

    def mark_leak(self, why: str) -> None:
        self.leak = why
        self.fields.update(private=False, epsilon_spent=math.inf)

    def epsilon(self, steps: int) -> float:
        """ε spent after `steps` steps, and no less than an earlier attempt of the run released: math.inf when
        nothing is accounted or the run leaks; NaN on torchrun's ranks other than 0, which write no summary."""
        if not self.accounted or self.leak is not None:
            return math.inf
        if not distributed.is_main():
            return math.nan
        return max(epsilon_spent(self.sigma, self.delta, self.sample_rate, steps, **self.accountant), self.released)

