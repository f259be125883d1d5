"""A private run's state (`MechanismState`): every key its checkpoint holds, and what its mechanism
(`dpmem.privacy.mechanism.GaussianMechanism`) changes as it releases; and an older checkpoint's layout read as
today's (`legacy_checkpoint`)."""

from __future__ import annotations

from dpmem.config import ConfigError
from dpmem.privacy.correlated import CorrelatedNoise
from dpmem.privacy.randomness import Draws, os_key
from dpmem.privacy.strategies import Strategy


class MechanismState:
    """Every key a private run's checkpoint holds, and what its mechanism changes as it releases (`state_dict`): the
    noise's draws, the loss's, the batches' (`sampler`), the step's (`steps`: dp-sgd-rc's probes, FSDP's shard
    noise), the releases so far, correlated noise's state (bandmf's buffers), and the ε it must not go below. One
    per run: a mechanism derived from another (`dataclasses.replace`, a broken one of `dpmem.audit.variants`)
    continues its state, so the trainer's and the method's mechanisms release, count and account as one."""

    def __init__(self, noise: Draws | None, sampler: Draws | None = None):
        self.noise, self.sampler = noise, sampler
        # keys drawn once per logical step, the same on every rank, from the noise's key (host-side: no sync)
        self.steps = Draws(noise.key, "steps", noise.device) if noise is not None else None
        self.loss: Draws | None = None  # the loss's draws apart from the gradient's: only rank 0 draws them
        self.correlated: CorrelatedNoise | None = None
        self.releases = 0  # gradient releases so far (steps), counted by `GaussianMechanism.release`
        self.leak: str | None = None  # why a private run is not private after all (a subspace from its own data)
        self.released = 0.0  # the most ε an earlier attempt of this run recorded (privacy.jsonl): already spent
        self.flat_runs = None  # a compiled step's runs over its flat sum, the same every step (`release`)
        self.reseeded: str | None = None  # why a resumed run's noise is keyed afresh (`load_state_dict`)
        self._made_for = None

    def made_for(self, loss_noised: bool, strategy: Strategy | None, restart: int | None) -> None:
        """The loss's draws and correlated noise as a mechanism of this loss release and strategy draws them, from
        the same key: made again where a derived mechanism changes them (the planner's strategy), before the first
        release only (a release's noise is then the strategy's it was drawn with)."""
        wanted = (loss_noised, strategy, restart)
        if wanted == self._made_for:
            return
        if self.releases:
            raise RuntimeError("a mechanism's loss release or noise strategy changed after it released: derive it "
                               "before the first step")
        key, device = (self.noise.key, self.noise.device) if self.noise is not None else (None, None)
        self.loss = Draws(key, "loss", device) if key is not None and loss_noised else None
        correlated = strategy is not None and strategy.name != "independent"
        self.correlated = CorrelatedNoise(strategy, key, restart) if correlated else None
        self._made_for = wanted

    def batches(self) -> Draws | None:
        """The sampler's draws from the first step's: step t's batch is draw t (a resumed run draws the lost steps'
        again, to skip them)."""
        if self.sampler is not None:
            self.sampler.count = 0
        return self.sampler

    def state_dict(self) -> dict:
        """The keys (and counts) of every draw, the releases so far and correlated noise's state. As private as the
        data: it derives the noise and the batches."""
        state = {"releases": self.releases}
        for name, draws in (("sampler", self.sampler), ("steps", self.steps), ("loss_noise", self.loss)):
            if draws is not None:
                state[name] = draws.state_dict()
        if self.noise is not None:
            state["noise"] = {**self.noise.state_dict(), "device": self.noise.device.type}
        if self.correlated is not None:
            state["correlated"] = self.correlated.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """The saved state, if its noise was drawn on this kind of device. A CUDA draw and a CPU draw of one key
        differ (two Philox streams, numpy's PCG64DXSM): on another device independent noise is keyed afresh from the
        OS (steps redrawn after the checkpoint get new noise), and `reseeded` says why; correlated noise cannot
        be (its past draws are the strategy's), and is refused. The batches' and the step's keys are host-side:
        they carry over. (A checkpoint of before 2026-12-07 kept those two apart: `legacy_checkpoint`.)"""
        self.releases = state.get("releases", self.releases)
        for name, draws in (("sampler", self.sampler), ("steps", self.steps)):
            if draws is not None and name in state:
                draws.load_state_dict(state[name])
        saved = state.get("noise")
        if saved is None or self.noise is None:
            return
        if saved["device"] != self.noise.device.type:
            why = f"the checkpoint's noise was drawn on {saved['device']}, this run is on {self.noise.device.type}"
            if self.correlated is not None:
                raise ConfigError("train.device", f"{why}: correlated noise continues its earlier draws, which only "
                                  f"the same kind of device draws again; resume it on {saved['device']}")
            self.noise.key = os_key()
            if self.loss is not None:
                self.loss.key = self.noise.key
            self.reseeded = why
            return
        self.noise.load_state_dict(saved)
        if self.loss is not None and "loss_noise" in state:
            self.loss.load_state_dict(state["loss_noise"])
        if self.correlated is not None:
            self.correlated.key = self.noise.key
            self.correlated.load_state_dict(state["correlated"], self.noise.device)


def legacy_checkpoint(state: dict) -> dict:
    """A checkpoint of before 2026-12-07 in today's layout: the batches' key was the checkpoint's `sampler_key`, and
    the mechanism's state, the step's keys (and, earlier still, the noise's and the loss's draws) the method's."""
    if "sampler_key" not in state:
        return state
    method = dict(state.get("method") or {})
    mechanism = method.pop("mechanism", None) or {k: method[k] for k in ("noise", "loss_noise") if k in method}
    for k in ("noise", "loss_noise"):
        method.pop(k, None)
    if "steps" in method:
        mechanism["steps"] = method.pop("steps")
    mechanism["sampler"] = {"key": state["sampler_key"], "purpose": "batches", "count": 0}
    return {**{k: v for k, v in state.items() if k != "sampler_key"}, "method": method, "mechanism": mechanism}
