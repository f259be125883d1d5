"""The state of correlated noise (DP matrix factorization, `dpmem.privacy.strategies`): the noise of release i is
w_i = (C⁻¹ z)_i, z_i standard normal, one vector per run of the release (`GaussianMechanism._runs`: a flat slice of
the clipped sums, or a rank's shard of them, or DPZero's scalar), so that the noise's prefix sums are B z.

- bandmf (C banded, b bands): w_i = (z_i − Σ_{j=1}^{b−1} c_j w_{i−j}) / c_0, the last b − 1 noise vectors kept
  (`buffers`, in the space the sums live in: r × n per matrix under DP-GRAPE).
- bisr (C⁻¹ banded, p bands): w_i = Σ_{j<p} d_j z_{i−j}, each past z drawn again from its key: nothing kept.

z of release i and run k is keyed by (the noise's key, i, k) alone, so a resumed run (or a regenerating step) draws
the same values. A projected method's subspace changes every `restart` steps (its refresh F, at 1-based steps
t ≡ 0 mod F): the correlation restarts there, a block-diagonal C whose blocks are the strategy's leading ones (still
b-banded with column norms at most 1 for bandmf; entry-wise below the unrestarted C for bisr, whose sensitivity then
bounds it): the past noise lives in the old subspace, where cancelling it no longer helps.
"""

from __future__ import annotations

import torch

from dpmem import distributed
from dpmem.privacy.randomness import Draws, derive
from dpmem.privacy.strategies import Strategy


class CorrelatedNoise:
    """A correlated strategy's noise, release after release: `noise` gives each run's vector of the current release,
    `advance` moves to the next. Its state (`state_dict`) is the release index and bandmf's buffers."""

    def __init__(self, strategy: Strategy, key: bytes | None, restart: int | None = None):
        self.strategy, self.key, self.restart = strategy, key, restart
        self.index = 0  # the release the next `noise` calls are for (0-based)
        self.buffers: dict[str, list[torch.Tensor]] = {}  # run -> its last noise vectors, newest first (bandmf)

    def block_start(self, i: int) -> int:
        """The first release of release i's block: a projected method's window (t // F of its 1-based step t =
        i + 1) begins one; without `restart` there is one block."""
        if not self.restart:
            return 0
        return max(0, (i + 1) // self.restart * self.restart - 1)

    def noise(self, run: str, shape: tuple, device, dtype) -> torch.Tensor:
        """Run `run`'s standard-normal-scaled noise vector of the current release: a new tensor the caller may keep
        but not change (bandmf keeps it)."""
        i, s = self.index, self.strategy
        if s.name == "bisr":
            past = min(s.bands - 1, i - self.block_start(i))
            w = self._z(i, run, shape, device, dtype).mul_(s.coefs[0])
            for j in range(1, past + 1):
                w.add_(self._z(i - j, run, shape, device, dtype), alpha=s.coefs[j])
            return w
        w = self._z(i, run, shape, device, dtype)
        kept = self.buffers.get(run, [])
        for c, old in zip(s.coefs[1:], kept):
            w.sub_(old, alpha=c)
        w.div_(s.coefs[0])
        if s.buffers:
            self.buffers[run] = [w, *kept[:s.buffers - 1]]
        return w

    def advance(self) -> None:
        """The current release is done: the next one's, its block's first forgets the buffers."""
        self.index += 1
        if self.block_start(self.index) == self.index:
            self.buffers.clear()

    def fill_buffers(self) -> None:
        """Every run's buffers made full (zeros past those it holds: the values change no memory), for a plan's
        metered steps (`dpmem.engine.planner`): what a run holds from its b-th release on."""
        for kept in self.buffers.values():
            kept.extend(torch.zeros_like(kept[0]) for _ in range(self.strategy.buffers - len(kept)))

    def _z(self, i: int, run: str, shape: tuple, device, dtype) -> torch.Tensor:
        """z of release i, run `run`: keyed by (key, i, run); torch's generator where there is no key (a plan)."""
        if self.key is None:
            return torch.randn(shape, device=device, dtype=dtype)
        return Draws(derive(self.key, f"correlated/{run}", i), "noise", device).randn(*shape, dtype=dtype)

    def state_dict(self) -> dict:
        """The release index and the buffers. Under FSDP each rank's buffers are its shards' (runs named by rank):
        every rank's are gathered, and each takes its own back (`load_state_dict`)."""
        buffers = {run: [t.cpu() for t in kept] for run, kept in self.buffers.items()}
        if any("/" in run for run in buffers):  # every FSDP rank saves (checkpoint.save), so all take part
            buffers = {"by_rank": distributed.gathered(buffers)}
        return {"index": self.index, "buffers": buffers}

    def load_state_dict(self, state: dict, device) -> None:
        """`state_dict`'s, the buffers onto `device` (a checkpoint loads onto the CPU)."""
        self.index = state["index"]
        buffers = state["buffers"]
        if "by_rank" in buffers:
            buffers = buffers["by_rank"][distributed.rank()]
        self.buffers = {run: [t.to(device) for t in kept] for run, kept in buffers.items()}

    def tensors(self) -> list[torch.Tensor]:
        """The buffers, for the memory meter."""
        return [t for kept in self.buffers.values() for t in kept]
