"""checkpoint.pt: what a run needs to go on after it dies. Weights, method state (optimiser, projections, noise and
direction generators), every rank's global RNG (dropout), the sampler's seed and the summary so far, written
atomically. It holds the noise generator's state and the sampler's seed: keep it as private as the data.
(`dpmem.engine.folder.claim` decides whether a run folder's checkpoint is resumed.)"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dpmem import distributed, sharding
from dpmem.engine.assemble import Parts
from dpmem.engine.folder import fingerprint

FILE = "checkpoint.pt"


def save(run_dir: Path, step: int, cfg, parts: Parts, sampler_seed: int, summary: dict) -> None:
    """Under torchrun rank 0 writes it, with every rank's RNG state (the ranks' dropout masks differ); under FSDP
    every rank takes part in gathering the sharded tensors whole, and the file is the same."""
    rngs = distributed.gathered({"torch_rng": torch.get_rng_state(),
                                 "cuda_rng": torch.cuda.get_rng_state() if parts.device.type == "cuda" else None})
    fsdp, main = cfg.train.fsdp, distributed.is_main()
    model = sharding.model_state(parts.model) if fsdp else None
    method = parts.method.state_dict() if fsdp or main else None
    if not main:
        return
    state = {"step": step, "config": fingerprint(cfg), "world_size": len(rngs),
             "model": model if fsdp else parts.model.state_dict(), "method": method, "rngs": rngs,
             "sampler_seed": sampler_seed, "summary": summary}
    tmp = Path(run_dir) / (FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, Path(run_dir) / FILE)


def restore(state: dict, cfg, parts: Parts) -> int:
    """Load a checkpoint's weights, method state and this rank's RNG into the parts (under FSDP each rank takes its
    shards); returns its step."""
    if cfg.train.fsdp:
        sharding.load_model_state(parts.model, state["model"])
    else:
        parts.model.load_state_dict(state["model"])
    parts.method.load_state_dict(state["method"])
    rng = state["rngs"][distributed.rank()]
    torch.set_rng_state(rng["torch_rng"])
    if rng["cuda_rng"] is not None and parts.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda_rng"])
    return state["step"]


def remove(run_dir: Path) -> None:
    """A finished run resumes nothing."""
    (Path(run_dir) / FILE).unlink(missing_ok=True)
