"""A run folder is the record of a run's privacy budget spent, so nothing writes into one before its earlier contents
are judged: `claim` for a training run (resume, start afresh, or refuse), `tool_folder` for the other verbs, each
verb writing only into its own folders (`owner`, `check_owner`), one writer at a time (`FolderLock`). Refusals are
`FolderRefused` (a ConfigError: one line, exit 2; in a sweep, that run fails and the others go on), and touch
nothing."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from dpmem import distributed
from dpmem.config import ConfigError
from dpmem.engine.summary import PRIVACY_LEDGER, read_ledger, replace_file
from dpmem.privacy.state import legacy_checkpoint

# what a run leaves; train.overwrite=true removes them, never privacy.jsonl (append-only: every attempt's ε)
RECORDS = ("summary.json", "metrics.jsonl", "checkpoint.pt", "checkpoint.pt.tmp", "model.pt")
# train.* settings of how a run is (re)started, not what it computes: a checkpoint resumes whatever these say
# (dpmem.report.labels.NOT_TRAINING extends them to the report's sense of "the same run")
# (a compiled step equals the eager one, tests/test_compile.py: either resumes)
NOT_FINGERPRINTED = ("resume", "skip_done", "overwrite", "checkpoint_every", "device", "compile", "compile_backend",
                     "static_shapes", "save_model")
LOCK = ".lock"  # FolderLock's file: not a record (nothing refuses a folder for it, dpmem report does not list it)
MARK = ".dpmem"  # the verb's name (`mark`), for a folder the training records do not tell `owner` whose it is
TOOLS = ("train", "audit", "spectrum", "memory", "plan")
# a private search's folder (dpmem.engine.selection): its secret key and its released folder (the winner's config.yaml
# and model.pt, and selection.json), the holder's record of every trial (search.json, which tells K), and its trials
KEY_FILE, RELEASED, SELECTION, HOLDER = "selection.key", "selection", "selection.json", "search.json"
TRIAL = "trial-"  # a trial's folder: TRIAL and a name drawn from the key (`SearchState.name`)


class FolderRefused(ConfigError):
    """The run folder's earlier records cannot be resumed or overwritten as asked."""


def fingerprint(cfg) -> str:
    """The configuration a checkpoint belongs to (what resuming does not change)."""
    return json.dumps(_compared(OmegaConf.to_container(cfg, resolve=True)), sort_keys=True, default=str)


def _compared(tree: dict) -> dict:
    """What a resume (and train.skip_done) compares of a config's tree: its sections, less NOT_FINGERPRINTED."""
    for key in NOT_FINGERPRINTED:
        tree.setdefault("train", {}).pop(key, None)
    return {k: tree.get(k) for k in ("model", "data", "method", "privacy", "train")}


class FolderLock:
    """An exclusive lock on a run folder while a run writes it: flock on its `.lock`, which holds the holder's pid,
    host and start for the refusal a second run gets. Released by the OS when the holder dies (a stale `.lock` of a
    killed run is taken over), and by `release` when the run ends, which removes the file (and the folder, if
    `acquire` made it and nothing else was written)."""

    def __init__(self, run_dir: Path, key: str = "hydra.run.dir"):
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None
        self.made = False
        self.key = key  # the setting that names the folder, for a refusal

    def acquire(self) -> None:
        """Take the lock, or raise FolderRefused naming the process that holds it."""
        run_dir = self.path.parent
        while True:
            try:
                if not run_dir.exists():
                    run_dir.mkdir(parents=True, exist_ok=True)
                    self.made = True
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # the folder went between mkdir and open (its last holder removed it)
                continue
            except IsADirectoryError:  # the folder is writable: what is wrong is the lock's own name
                raise FolderRefused(self.key, f"{self.path} is a folder, where dpmem keeps the file that "
                                    "lets one run at a time write here: remove it, or give this run another folder "
                                    f"({self.key}=...)") from None
            except OSError as e:  # read-only, full, not a folder: nothing of a run could be written there
                raise FolderRefused(self.key, f"cannot write into {run_dir} ({e.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise FolderRefused(self.key, f"{run_dir} is being written by another dpmem run ({holder}): "
                                    "one run writes a folder at a time; wait for it to end (then this command "
                                    "resumes or refuses it as usual), or give this run another folder "
                                    f"({self.key}=...)") from None
            except OSError as e:  # a file system without locks: the run goes on, unguarded, and says so
                os.close(fd)
                print(f"dpmem: warning: cannot lock {self.path} ({e.strerror}): nothing stops another run from "
                      "writing into this folder at the same time", file=sys.stderr)
                return
            # the lock's last holder may have removed the file (and another made it again) since it was opened: the
            # lock that counts is on the file at the path
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.stat(self.path), os.fstat(fd)):
                    break
            os.close(fd)
        self.fd = fd
        # who holds it is for the message only (a full disk is met, and said, by the run's writes)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": datetime.datetime
                                      .now().isoformat(timespec="seconds")}).encode() + b"\n", 0)

    def __enter__(self) -> "FolderLock":  # for a tool that writes a folder without `claim`: with FolderLock(out): ...
        if distributed.is_main():
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)  # while still held: a run waiting to open it opens a new file
        os.close(self.fd)
        self.fd = None
        if self.made:
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()  # only if empty: a refusal or configuration error left nothing in it


def _holder(fd: int) -> str:
    """Who holds a lock, as its `.lock` says."""
    try:
        held = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {held['pid']} on {held['host']}, since {held['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet said which"


def claim(cfg, run_dir: Path, lock: FolderLock | None = None) -> dict | None:
    """The checkpoint to resume from, or None to start afresh, once the folder may be written. Raises FolderRefused
    (nothing written) for a folder another run holds `lock` on, for a checkpoint that cannot resume this run, and for
    earlier records that a fresh run would overwrite without `train.overwrite=true`. Rank 0 takes `lock` (if given)
    before it looks; the caller releases it when the run ends."""
    run_dir = Path(run_dir)
    state, verdict = None, None
    if distributed.is_main():  # rank 0 looks, and every rank waits for what it saw before any rank writes
        try:
            if lock is not None:
                lock.acquire()
            state = _look(cfg, run_dir)
            verdict = "resume" if state is not None else "fresh"
        except FolderRefused as e:
            verdict = (e.key, e.message)
    verdict = distributed.from_main(verdict)
    if isinstance(verdict, tuple):
        raise FolderRefused(*verdict)
    if verdict == "resume" and state is None:  # the other ranks read what rank 0 checked
        state = legacy_checkpoint(_load(run_dir / "checkpoint.pt"))
    return state


def _look(cfg, run_dir: Path) -> dict | None:
    """`claim`'s decision, on one process: the checkpoint's state, None to start afresh, or FolderRefused."""
    path, t = run_dir / "checkpoint.pt", cfg.train
    check_owner(run_dir, "train", t.overwrite)  # a user's own files, another verb's folder
    ledger = run_dir / PRIVACY_LEDGER
    if ledger.exists() and not ledger.is_file():  # the append-only ledger must be a file; nothing removes one
        raise FolderRefused("hydra.run.dir", f"{ledger} is not a file: the run's ε ledger goes there; move it away, "
                            "or give another hydra.run.dir")
    if owner(run_dir) not in (None, "train"):  # written into anyway (train.overwrite=true): nothing to resume
        mark(run_dir, "train")  # a training run's folder from now on, whatever verb's it was (`owner`, dpmem report)
    elif path.exists() and t.resume:
        state = _resumable(cfg, path)
        lost = _ledger_lost(cfg, run_dir, state["step"])
        if lost is None:
            return state
        if not t.overwrite:
            raise FolderRefused("train.resume", f"{lost}, and {path} holds the run at step {state['step']}: the "
                                "epsilon it spent cannot be known, so it is not resumed; put the ledger back, or "
                                "train.overwrite=true starts the run over (its records go, the ledger's lines stay)")
    held = _held(run_dir)
    if held is not None and not t.overwrite:
        how = "train.resume=true resumes it, " if path.exists() else ""
        raise FolderRefused("train.overwrite", f"{run_dir} holds {held}, which a new run would overwrite; {how}another "
                            "folder (hydra.run.dir=...) keeps it, train.overwrite=true replaces it")
    for name in RECORDS:  # (none is there where nothing is `held`; train.overwrite=true where another verb's)
        (run_dir / name).unlink(missing_ok=True)
    return None


def _ledger_lost(cfg, run_dir: Path, step: int) -> str | None:
    """Why the folder's privacy.jsonl cannot say what a private run resumed at `step` spent (missing, no readable
    line), in words; None where it can (or the run writes none: its method is not private)."""
    from dpmem.methods import method_class

    records, unreadable = read_ledger(run_dir)
    if records or not method_class(cfg.method.name).spec.private:
        return None
    ledger = run_dir / PRIVACY_LEDGER
    return (f"{ledger} has no readable line ({len(unreadable)} unreadable)" if ledger.exists()
            else f"{ledger} is missing")


def owner(folder: Path) -> str | None:
    """Whose folder `folder` is: None where it is missing or empty (a `.lock` aside), else a verb of TOOLS, or
    "other" (a user's own files); told by its MARK, else (an older dpmem's folder) by what each verb leaves."""
    folder = Path(folder)
    try:
        names = {e.name for e in folder.iterdir()} - {LOCK}
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return "other"
    if not names:
        return None
    with contextlib.suppress(OSError):
        if MARK in names and (said := (folder / MARK).read_text().strip()) in TOOLS:
            return said
    for tool, left in (("audit", {"audit.json", "audit.md"}), ("memory", {"memory.json"}), ("plan", {"plan.json"}),
                       ("spectrum", {"spectrum.json"})):
        if names & left:
            return tool
    if (folder / "gradients" / "index.json").exists():
        return "spectrum"
    if names & {*RECORDS, PRIVACY_LEDGER, "summary.json.tmp"}:  # what a training run writes first (audit's run too)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if (analysis := json.loads((folder / "summary.json").read_text()).get("analysis")) in TOOLS:
                return analysis
        return "train"
    return "other"


def check_owner(folder: Path, tool: str, overwrite: bool, key: str = "hydra.run.dir") -> None:
    """Raise FolderRefused (nothing written) where `folder` holds anything but `tool`'s own run, unless
    `overwrite` (train.overwrite=true) asks to write into it anyway."""
    if (part := search_part(folder)) is not None:
        raise FolderRefused(key, f"{folder} is {part}: dpmem {tool} never writes there, whatever train.overwrite "
                            f"says; give it another folder ({key}=...)")
    holder = owner(folder)
    if tool != "train" and (holder == "train" or (Path(folder) / PRIVACY_LEDGER).exists()):
        raise FolderRefused(key, f"{folder} holds a training run (its ε ledger, {PRIVACY_LEDGER}, records what it "
                            f"released): dpmem {tool} never writes into one, whatever train.overwrite says; give it "
                            f"another folder ({key}=...)")
    if holder in (None, tool) or overwrite:
        return
    if holder == "other":
        names = sorted(e.name for e in Path(folder).iterdir() if e.name != LOCK)
        what = f"is not empty ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) and holds no dpmem run"
    else:
        what = "holds a training run" if holder == "train" else f"is a dpmem {holder} folder"
    raise FolderRefused(key, f"{folder} {what}: dpmem {tool} writes only into an empty folder or one of its own; "
                        f"give it another folder ({key}=...), or train.overwrite=true writes into this one")


def _is_search(folder: Path) -> bool:
    """`folder` holds a private search: its key, the holder's record or a release."""
    return (folder / KEY_FILE).exists() or (folder / HOLDER).exists() or (folder / RELEASED / SELECTION).is_file()


def search_part(folder: Path) -> str | None:
    """What of a private search `folder` is, in words: its folder, its release (selection/, or a copy of it), or a
    folder inside its folder that is not one of its trials as the search runs it; None for any other. No verb writes
    into one (`check_owner`): a run there would replace the release or hide among the trials."""
    folder = Path(folder).absolute()
    if _is_search(folder):
        return f"a private search's folder (its {KEY_FILE}, trials and {RELEASED}/ release)"
    if (folder / SELECTION).is_file() or (folder.name == RELEASED and _is_search(folder.parent)):
        return f"a private search's release ({RELEASED}/: what it publishes, at the search's ε)"
    if not _is_search(folder.parent):
        return None
    hydra = HydraConfig.get() if HydraConfig.initialized() else None
    trial = (hydra is not None and str(hydra.sweeper.get("_target_", "")).endswith(".PrivateSweeper")
             and Path(hydra.sweep.dir).absolute() == folder.parent and folder.name.startswith(TRIAL))
    return None if trial else "inside a private search's folder, where only its trials go"


def mark(folder: Path, tool: str) -> None:
    """`folder` marked as `tool`'s (see `owner`)."""
    folder.mkdir(parents=True, exist_ok=True)
    replace_file(folder / MARK, f"{tool}\n".encode())


def _recorded_config(run_dir: Path) -> dict | None:
    """The configuration the folder's run recorded (its resolved config.yaml; else .hydra/config.yaml), as
    `as_recorded` gives it; None where neither can be read."""
    for path in (run_dir / "config.yaml", run_dir / ".hydra" / "config.yaml"):
        try:
            return as_recorded(OmegaConf.load(path))
        except Exception:  # noqa: BLE001  (missing, not YAML, an interpolation that no longer resolves)
            continue
    return None


def as_recorded(cfg) -> dict:
    """What `fingerprint` compares, as config.yaml records it (enums by name)."""
    return _compared(OmegaConf.to_container(OmegaConf.create(OmegaConf.to_yaml(cfg, resolve=True)), resolve=True))


def skip_done(cfg, run_dir: Path) -> dict | None:
    """train.skip_done: the summary of the folder's run if it finished ok with this configuration (as a resume
    compares it), on every rank; else None, and the run goes on as without skip_done (resumed or refused there). A
    run that finished ok with another configuration raises FolderRefused naming what differs."""
    verdict = _done(cfg, Path(run_dir)) if distributed.is_main() else None
    verdict = distributed.from_main(verdict)  # every rank skips, or none (with rank 0's summary: one objective)
    if isinstance(verdict, tuple):
        raise FolderRefused(*verdict)
    return verdict


def _done(cfg, run_dir: Path) -> dict | tuple | None:
    """`skip_done`'s verdict, on rank 0: the summary, None, or a refusal's (key, message). An unreadable summary or
    config.yaml is not taken for done, and said so in one line."""
    path = run_dir / "summary.json"
    if owner(run_dir) != "train" or not path.exists():
        return None
    try:
        s = json.loads(path.read_text())
        if not isinstance(s, dict):
            raise ValueError("not a JSON object")
    except (ValueError, OSError) as e:
        print(f"dpmem: warning: {path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:80]}): not "
              "taken as done (train.skip_done)", file=sys.stderr)
        return None
    if s.get("status") != "ok":
        return None
    recorded = _recorded_config(run_dir)
    if recorded is None:
        print(f"dpmem: warning: {run_dir} holds a finished run but no readable config.yaml: which configuration it "
              "ran cannot be told, so it is not taken as done (train.skip_done)", file=sys.stderr)
        return None
    if changed := _changes(recorded, as_recorded(cfg)):
        return ("train.skip_done", f"{run_dir} holds a run that finished ok with another configuration ({changed}), "
                "not this one's result; give this run another folder (hydra.run.dir=...), or train.overwrite=true "
                "replaces it")
    return s


def _held(run_dir: Path) -> str | None:
    """What earlier run the folder holds, in words (None: nothing a run would overwrite)."""
    summary = run_dir / "summary.json"
    if summary.exists():
        try:
            s = json.loads(summary.read_text())
            return (f"a run ({s.get('status')}, {s.get('steps_done')} steps, epsilon spent {s.get('epsilon_spent')}) "
                    f"recorded in {summary.name}")
        except (ValueError, OSError, AttributeError):  # (AttributeError: JSON, but not an object)
            return f"an unreadable {summary.name}"
    present = [name for name in (*RECORDS, PRIVACY_LEDGER) if (run_dir / name).exists()]
    return f"an earlier run's {', '.join(present)}" if present else None


def _resumable(cfg, path: Path) -> dict:
    """The checkpoint's state, if it can resume this run (readable, as many processes, the same configuration)."""
    try:
        state = legacy_checkpoint(_load(path))  # an older checkpoint's layout read as today's
        missing = [k for k in ("step", "config", "world_size", "model", "method", "mechanism", "rngs", "summary")
                   if k not in state]
    except Exception as e:  # noqa: BLE001  (a truncated file fails in zipfile, pickle or torch, each its own way)
        raise FolderRefused("train.resume", f"{path} is not a readable checkpoint ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else 'empty'}); move it away and start again with "
                            "train.overwrite=true, or resume from a good copy") from None
    if missing:
        raise FolderRefused("train.resume", f"{path} is not a dpmem checkpoint (no {', '.join(missing)})")
    world = distributed.world_size()
    if state["world_size"] != world:
        raise FolderRefused("train.resume", f"{path} was written by a run of {state['world_size']} process(es) and "
                            f"this one has {world}: resume it with torchrun --nproc_per_node={state['world_size']} "
                            "(each rank's dropout state is its own), or start again in another folder")
    if changed := _changes(json.loads(state["config"]), json.loads(fingerprint(cfg))):
        raise FolderRefused("train.resume", f"{path} was written by another configuration ({changed}): run it as it "
                            "was to resume, or another folder (hydra.run.dir=...) for this one")
    return state


def _load(path: Path) -> dict:
    """On the CPU: generator states are CPU tensors whatever their generator's device; weights and optimiser state
    go to the parameters' device as they load (a checkpoint written on CUDA resumes on the CPU too)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def written_checkpoint(run_dir: Path) -> dict | None:
    """The step and summary fields (`dpmem.engine.trainer.RESUMED`) of a folder's checkpoint.pt, read without
    loading its tensors (`dpmem report` on a folder whose records are gone); None where there is none or it cannot
    be read."""
    try:
        state = torch.load(Path(run_dir) / "checkpoint.pt", map_location="cpu", weights_only=True, mmap=True)
        step, summary = state["step"], state["summary"]
    except Exception:  # noqa: BLE001  (missing, truncated, not a dpmem checkpoint: each fails its own way)
        return None
    if not (isinstance(step, int) and step > 0 and isinstance(summary, dict)):
        return None
    return {"step": step, "summary": summary}


def _changes(old: dict, new: dict) -> str:
    """'key: old -> new' for the first three leaves that differ ('; ...' where more do); '' where none does."""
    def leaves(a: dict, b: dict, prefix: str = ""):
        for key in sorted(set(a) | set(b)):
            x, y = a.get(key), b.get(key)
            if isinstance(x, dict) and isinstance(y, dict):
                yield from leaves(x, y, f"{prefix}{key}.")
            elif x != y:
                yield f"{prefix}{key}: {x} -> {y}"
    changed = list(leaves(old, new))
    return "; ".join(changed[:3]) + ("; ..." if len(changed) > 3 else "")


def write_config(cfg, run_dir: Path) -> None:
    """The run's configuration, once the folder is claimed and the run prepared: `config.yaml` resolved, and under
    Hydra its `.hydra/` (config.yaml, hydra.yaml, overrides.yaml, as Hydra writes them)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    replace_file(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True).encode())  # whole or as it was
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        (run_dir / ".hydra").mkdir(exist_ok=True)
        for name, tree in (("config", cfg), ("hydra", {"hydra": hc}), ("overrides", list(hc.overrides.task))):
            replace_file(run_dir / ".hydra" / f"{name}.yaml", OmegaConf.to_yaml(tree).encode())


def drop_if_empty(run_dir: Path) -> None:
    """After a configuration error: the folder Hydra made for the run goes again if nothing was written to it."""
    if distributed.is_main() and run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def given(overrides: list[str], key: str) -> str | None:
    """The last value of `key=...` among the overrides, if any."""
    return next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(key + "=")), None)


def check_output(key: str, name: str) -> None:
    """Before anything is made: the folder `name` (its part before any ${...}) can be made, that is, its nearest
    existing ancestor is a folder this process can create folders in. Raises ConfigError naming the key."""
    if not name.strip():
        raise ConfigError(key, "is empty, which would write into the current folder; name a folder "
                          f"({key}=outputs/my-run) or leave it out for a new dated one")
    base = Path(name.split("${")[0] or ".").expanduser().absolute()
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise ConfigError(key, f"{name}: {base} is a file, not a folder")
    try:
        tempfile.TemporaryDirectory(dir=base, prefix=".dpmem-check-").cleanup()
    except OSError as e:
        raise ConfigError(key, f"{name}: cannot make a folder in {base} ({e.strerror or type(e).__name__}); "
                          "name a folder you can write") from None


def tool_dir(overrides: list[str], alias_key: str, alias: str | None, dated: str) -> tuple[Path, str]:
    """Where memory, plan, spectrum and audit write, and the key that named it: hydra.run.dir=..., as for train, else
    their own *.dir, else a dated folder under outputs/; checked writable, and absolute (as train's run_dir is)."""
    name = given(overrides, "hydra.run.dir")
    key, name = ("hydra.run.dir", name) if name is not None else (alias_key, alias or
                                                                 datetime.datetime.now().strftime(dated))
    check_output(key, name)
    return Path(name).expanduser().absolute(), key


@contextlib.contextmanager
def tool_folder(out: Path, tool: str, overwrite: bool, key: str, mark_first: bool = False):
    """A tool's output folder while the tool works in it: locked (`FolderLock`), refused where it holds another
    tool's records (`check_owner`; a training run's always, whatever train.overwrite says: its ledger and records
    are what it released), and marked as the tool's (first for audit and spectrum, which write as they go). A tool
    refused (ConfigError) before it wrote more than its mark and config.yaml leaves a folder that was empty as it
    was."""
    with FolderLock(out, key):
        check_owner(out, tool, overwrite, key)
        fresh = owner(out) is None
        if mark_first:
            mark(out, tool)
        try:
            yield
        except ConfigError:
            if fresh and {p.name for p in out.iterdir()} <= {MARK, "config.yaml", LOCK}:
                for name in (MARK, "config.yaml"):
                    (out / name).unlink(missing_ok=True)
            raise
        if not mark_first:
            mark(out, tool)
