"""checkpoint.pt: what a run needs to go on after it dies (weights, the method's state, the mechanism's with every
key and count it draws with: noise, batches, step keys; every rank's RNG, the summary so far), written atomically.
It holds the secret keys of the noise and the batches: as private as the data, removed when the run ends
(docs/run-folders.md). `dpmem.engine.folder.claim` resumes it (an older layout too: `legacy_checkpoint`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dpmem import distributed, sharding
from dpmem.engine.assemble import Parts
from dpmem.engine.folder import fingerprint
from dpmem.engine.summary import reraise

FILE = "checkpoint.pt"
TMP = FILE + ".tmp"  # a save cut short leaves it: never resumed, removed when the run ends


def save(run_dir: Path, step: int, cfg, parts: Parts, summary: dict) -> None:
    """Under torchrun rank 0 writes it, with every rank's RNG state (the ranks' dropout masks differ); under FSDP
    every rank takes part in gathering the sharded tensors whole, and the file is the same."""
    rngs = distributed.gathered({"torch_rng": torch.get_rng_state(),
                                 "cuda_rng": torch.cuda.get_rng_state() if parts.device.type == "cuda" else None})
    fsdp, main = cfg.train.fsdp, distributed.is_main()
    model = sharding.model_state(parts.model) if fsdp else None
    method = parts.method.state_dict() if fsdp or main else None
    mechanism = parts.mechanism.state_dict() if fsdp or main else None  # correlated noise's FSDP shards gathered
    if not main:
        return
    state = {"step": step, "config": fingerprint(cfg), "world_size": len(rngs),
             "model": model if fsdp else parts.model.state_dict(), "method": method, "mechanism": mechanism,
             "rngs": rngs, "summary": summary}
    tmp = Path(run_dir) / TMP
    try:  # through a Python file: a full disk is then an OSError with its errno, not the zip writer's RuntimeError
        with open(tmp, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, Path(run_dir) / FILE)
    except BaseException as e:  # a failed (or interrupted) save leaves the last good checkpoint, and no partial one
        tmp.unlink(missing_ok=True)
        reraise(e, Path(run_dir) / FILE, _nbytes(state))


def _nbytes(obj) -> int:
    """About the size of a checkpoint's state on disk: its tensors' bytes."""
    if isinstance(obj, (dict, list, tuple)):
        return sum(map(_nbytes, obj.values() if isinstance(obj, dict) else obj))
    return obj.numel() * obj.element_size() if isinstance(obj, torch.Tensor) else 0


def restore(state: dict, cfg, parts: Parts) -> int:
    """Load a checkpoint's weights, method and mechanism state and this rank's RNG into the parts (under FSDP each
    rank takes its shards); returns its step."""
    if cfg.train.fsdp:
        sharding.load_model_state(parts.model, state["model"])
    else:
        parts.model.load_state_dict(state["model"])
    parts.method.load_state_dict(state["method"])
    parts.mechanism.load_state_dict(state["mechanism"])
    rng = state["rngs"][distributed.rank()]
    torch.set_rng_state(rng["torch_rng"])
    if rng["cuda_rng"] is not None and parts.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda_rng"])
    return state["step"]


def remove(run_dir: Path) -> None:
    """A finished run resumes nothing, and keeps none of the secrets a checkpoint holds (a killed save's .tmp too)."""
    for name in (FILE, TMP):
        (Path(run_dir) / name).unlink(missing_ok=True)


MODEL = "model.pt"


def save_model(run_dir: Path, cfg, parts: Parts) -> None:
    """train.save_model: the final weights alone (a state dict, loadable with weights_only=True), atomically; no key
    of the noise or the batches, so it may be released with the run (a private search releases its winner's)."""
    weights = sharding.model_state(parts.model) if cfg.train.fsdp else parts.model.state_dict()
    if not distributed.is_main():
        return
    tmp = Path(run_dir) / (MODEL + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save({k: v.detach().cpu() for k, v in weights.items()}, f)
        os.replace(tmp, Path(run_dir) / MODEL)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        reraise(e, Path(run_dir) / MODEL, _nbytes(weights))
