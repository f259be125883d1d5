"""A run folder is the record of a run's privacy budget spent. Before a run writes anything into one, `claim` decides
what the folder's earlier contents allow: resume from its checkpoint (checked readable and of this configuration
first), start afresh in an empty folder, or, where a finished or failed run's records would be overwritten, refuse
unless `train.overwrite=true` asks for it (privacy.jsonl, the record of ε spent, is kept even then). Refusals are
`FolderRefused` (a ConfigError: one line, exit 2; in a sweep, that run fails and the others go on), and nothing
is touched."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from dpmem import distributed
from dpmem.config import ConfigError
from dpmem.engine.summary import PRIVACY_LEDGER

# what a run leaves; train.overwrite=true removes them, never privacy.jsonl (append-only: every attempt's ε)
RECORDS = ("summary.json", "metrics.jsonl", "checkpoint.pt", "checkpoint.pt.tmp")
# train.* settings of how a run is (re)started, not what it computes: a checkpoint resumes whatever these say
# (dpmem.report.labels.NOT_TRAINING extends them to the report's sense of "the same run")
NOT_FINGERPRINTED = ("resume", "skip_done", "overwrite", "checkpoint_every", "device")


class FolderRefused(ConfigError):
    """The run folder's earlier records cannot be resumed or overwritten as asked."""

    def __init__(self, key: str, message: str):
        super().__init__(key, message)
        self.message = message


def fingerprint(cfg) -> str:
    """The configuration a checkpoint belongs to (what resuming does not change)."""
    tree = OmegaConf.to_container(cfg, resolve=True)
    for key in NOT_FINGERPRINTED:
        tree["train"].pop(key, None)
    return json.dumps({k: tree.get(k) for k in ("model", "data", "method", "privacy", "train")}, sort_keys=True,
                      default=str)


def claim(cfg, run_dir: Path) -> dict | None:
    """The checkpoint to resume from, or None to start afresh, once the folder may be written. Raises FolderRefused
    (nothing written) for a checkpoint that cannot resume this run, and for earlier records that a fresh run would
    overwrite without `train.overwrite=true`."""
    run_dir = Path(run_dir)
    state, verdict = None, None
    if distributed.is_main():  # rank 0 looks, and every rank waits for what it saw before any rank writes
        try:
            state = _look(cfg, run_dir)
            verdict = "resume" if state is not None else "fresh"
        except FolderRefused as e:
            verdict = (e.key, e.message)
    verdict = distributed.from_main(verdict)
    if isinstance(verdict, tuple):
        raise FolderRefused(*verdict)
    if verdict == "resume" and state is None:  # the other ranks read what rank 0 checked
        state = _load(run_dir / "checkpoint.pt")
    return state


def _look(cfg, run_dir: Path) -> dict | None:
    """`claim`'s decision, on one process: the checkpoint's state, None to start afresh, or FolderRefused."""
    path, t = run_dir / "checkpoint.pt", cfg.train
    if path.exists() and t.resume:
        return _resumable(cfg, path)
    held = _held(run_dir)
    if held is not None and not t.overwrite:
        how = "train.resume=true resumes it, " if path.exists() else ""
        raise FolderRefused("train.overwrite", f"{run_dir} holds {held}, which a new run would overwrite; {how}another "
                          "folder (hydra.run.dir=...) keeps it, train.overwrite=true replaces it")
    if held is not None:
        for name in RECORDS:
            (run_dir / name).unlink(missing_ok=True)
    return None


def _held(run_dir: Path) -> str | None:
    """What earlier run the folder holds, in words (None: nothing a run would overwrite)."""
    summary = run_dir / "summary.json"
    if summary.exists():
        try:
            s = json.loads(summary.read_text())
            return (f"a run ({s.get('status')}, {s.get('steps_done')} steps, epsilon spent {s.get('epsilon_spent')}) "
                    f"recorded in {summary.name}")
        except (ValueError, OSError):
            return f"an unreadable {summary.name}"
    present = [name for name in (*RECORDS, PRIVACY_LEDGER) if (run_dir / name).exists()]
    return f"an earlier run's {', '.join(present)}" if present else None


def _resumable(cfg, path: Path) -> dict:
    """The checkpoint's state, if it can resume this run (readable, as many processes, the same configuration)."""
    try:
        state = _load(path)
        missing = [k for k in ("step", "config", "world_size", "model", "method", "rngs", "summary", "sampler_key")
                   if k not in state]
    except Exception as e:  # noqa: BLE001  (a truncated file fails in zipfile, pickle or torch, each its own way)
        raise FolderRefused("train.resume", f"{path} is not a readable checkpoint ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else 'empty'}); move it away and start again with "
                          "train.overwrite=true, or resume from a good copy") from None
    if missing:
        raise FolderRefused("train.resume", f"{path} is not a dpmem checkpoint (no {', '.join(missing)})")
    world = distributed.world_size()
    if state["world_size"] != world:
        raise FolderRefused("train.resume", f"{path} was written by a run of {state['world_size']} process(es) and this "
                          f"one has {world}: resume it with torchrun --nproc_per_node={state['world_size']} (each "
                          "rank's dropout state is its own), or start again in another folder")
    changed = _changed(json.loads(state["config"]), json.loads(fingerprint(cfg)))
    if changed:
        raise FolderRefused("train.resume", f"{path} was written by another configuration ({'; '.join(changed[:3])}"
                          f"{'; ...' if len(changed) > 3 else ''}): run it as it was to resume, or another folder "
                          "(hydra.run.dir=...) for this one")
    return state


def _load(path: Path) -> dict:
    """On the CPU: generator states are CPU tensors whatever their generator's device; weights and optimiser state
    go to the parameters' device as they load (a checkpoint written on CUDA resumes on the CPU too)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _changed(old: dict, new: dict, prefix: str = "") -> list[str]:
    """'key: old -> new' for every leaf that differs."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a} -> {b}")
    return out


def write_config(cfg, run_dir: Path) -> None:
    """The run's configuration, once the folder is claimed and the run prepared: `config.yaml` resolved, and under
    Hydra its `.hydra/` (config.yaml, hydra.yaml, overrides.yaml, as Hydra writes them)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        (run_dir / ".hydra").mkdir(exist_ok=True)
        (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        (run_dir / ".hydra" / "hydra.yaml").write_text(OmegaConf.to_yaml({"hydra": hc}))
        (run_dir / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(list(hc.overrides.task)))


def drop_if_empty(run_dir: Path) -> None:
    """After a configuration error: the folder Hydra made for the run goes again if nothing was written to it."""
    if distributed.is_main() and run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()
