"""The run folder's records: metrics.jsonl lines, privacy.jsonl (append-only: ε spent), summary.json (rewritten
atomically, so a run that dies leaves a readable one) and the short table printed at the end. A write that fails
leaves no partial line or file behind (`append_line`, `replace_file`); a full disk is `DiskFull`, in one line."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import torch

import dpmem


def versions() -> dict:
    import transformers

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(dpmem.__file__).parent,
                             capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {"dpmem": dpmem.__version__, "git": rev, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def json_ready(value):
    """JSON has no inf or nan: an infinite value (ε of a run that is not private, the rc envelope's d) is written
    "inf" (float("inf") reads it back), nan null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


class DiskFull(OSError):
    """A write into the run folder found the disk full (ENOSPC) or the quota spent (EDQUOT): the run ends failed with
    this one line (the file is left as it was: `replace_file`, `append_line`)."""

    def __init__(self, path: Path, nbytes: int | None = None, code: int = errno.ENOSPC):
        what = "the disk quota is exceeded" if code == errno.EDQUOT else "the disk is full"
        size = f" (writing {_size(nbytes)})" if nbytes else ""
        self.message = (f"{path}: {what}{size}; free some space (or give the run another folder) and start it "
                        "again: a run with a checkpoint resumes from it")
        self.nbytes = nbytes
        super().__init__(code, self.message, str(path))

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # a launcher's job process sends it back pickled
        return DiskFull, (self.filename, self.nbytes, self.errno)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"about {nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def reraise(e: BaseException, path: Path, nbytes: int) -> NoReturn:
    """Raise `e` again: as DiskFull (naming `path` and `nbytes`) where it found the disk full or the quota spent."""
    if isinstance(e, DiskFull) or not (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)):
        raise e
    raise DiskFull(path, nbytes, e.errno) from None


def replace_file(path: Path, data: bytes) -> None:
    """`path` holds `data`, or (a write that fails) what it held before: written to path.tmp, then renamed over it.
    Raises DiskFull for a full disk."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        reraise(e, path, len(data))


def append_line(path: Path, record: dict, sync: bool = False) -> None:
    """One JSON line at the end of `path`, on a line of its own (a newline first where the file's last line was cut
    short). A write that fails leaves the file as it was. Raises DiskFull for a full disk."""
    path, data, end = Path(path), (json.dumps(json_ready(record)) + "\n").encode(), None
    try:
        with open(path, "a+b", buffering=0) as f:  # unbuffered: what fails, fails here, and nothing is left to flush
            end = f.seek(0, os.SEEK_END)
            if end:
                f.seek(end - 1)
                if f.read(1) != b"\n":
                    data = b"\n" + data
            view = memoryview(data)
            while view:  # O_APPEND: every write lands at the end
                view = view[f.write(view):]
            if sync:
                os.fsync(f.fileno())
    except OSError as e:
        if end is not None:  # no partial line is left for the next append to land on
            with contextlib.suppress(OSError):
                os.truncate(path, end)
        reraise(e, path, len(data))


def write_summary(run_dir: Path, summary: dict) -> None:
    replace_file(Path(run_dir) / "summary.json", (json.dumps(json_ready(summary), indent=2) + "\n").encode())


METRICS = "metrics.jsonl"


def append_metrics(run_dir: Path, record: dict) -> None:
    append_line(Path(run_dir) / METRICS, record)


def cut_metrics(run_dir: Path, step: int) -> None:
    """A resumed run's metrics.jsonl: the readable records up to `step` (the checkpoint's; the steps after it are run
    and recorded again), the rest dropped; a line that cannot be read (cut short by a crash, damaged) is dropped and
    said so, in one line."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return
    kept, unreadable = [], 0
    for raw in path.read_bytes().split(b"\n"):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            at = record["step"]
            if not isinstance(at, int) or isinstance(at, bool):
                raise ValueError(at)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            unreadable += 1
            continue
        if at <= step:
            kept.append(raw.strip() + b"\n")
    replace_file(path, b"".join(kept))
    if unreadable:
        print(f"dpmem: warning: {path}: {unreadable} unreadable line(s) dropped (cut short or damaged); its "
              f"{len(kept)} readable record(s) up to step {step} are kept and the steps after it recorded again",
              file=sys.stderr)


PRIVACY_LEDGER = "privacy.jsonl"


def append_privacy(run_dir: Path, record: dict) -> None:
    """One line of the run folder's append-only record of ε spent, on disk (fsync) before the step after it runs.
    No dpmem command truncates or rewrites it: a run started again in the folder (resumed or overwritten) adds its
    own, on a line of its own."""
    append_line(Path(run_dir) / PRIVACY_LEDGER, record, sync=True)


def _ledger_line(raw: bytes) -> dict | None:
    """A line of privacy.jsonl, or None where it cannot be read: not UTF-8 JSON of an object, an ε that is not a
    number >= 0 (or "inf", as json_ready writes infinity), steps that are not a count."""
    try:
        record = json.loads(raw.decode())
        eps, steps = record.get("epsilon"), record.get("steps_done")
    except (ValueError, AttributeError):  # not UTF-8 JSON (UnicodeDecodeError is a ValueError), not an object
        return None
    if eps is not None and not (eps == "inf" or (isinstance(eps, (int, float)) and not isinstance(eps, bool)
                                                 and eps >= 0)):  # NaN fails >= 0 too
        return None
    if steps is not None and not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0):
        return None
    return record


def read_ledger(run_dir: Path) -> tuple[list[dict], list[int]]:
    """privacy.jsonl's readable lines, and the numbers of those it cannot read (none of either: no ledger)."""
    path = Path(run_dir) / PRIVACY_LEDGER
    if not path.exists():
        return [], []
    if not path.is_file():  # a folder, say: a ledger that exists and holds no readable line
        return [], [0]
    lines = [(number, _ledger_line(raw)) for number, raw in enumerate(path.read_bytes().split(b"\n"), 1) if raw.strip()]
    return [r for _, r in lines if r is not None], [number for number, r in lines if r is None]


_warned: set = set()


def privacy_records(run_dir: Path) -> list[dict]:
    """The ledger's readable lines (`_ledger_line`); the others skipped, said so in one warning (once per ledger and
    damage)."""
    records, unreadable = read_ledger(run_dir)
    path = Path(run_dir) / PRIVACY_LEDGER
    if unreadable == [0] and (str(path), 0) not in _warned:
        _warned.add((str(path), 0))
        print(f"dpmem: warning: {path} is not a file: no epsilon can be read from it", file=sys.stderr)
    elif unreadable and (str(path), tuple(unreadable)) not in _warned:
        _warned.add((str(path), tuple(unreadable)))
        shown = ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else "")
        print(f"dpmem: warning: {path}: {len(unreadable)} unreadable line(s) skipped (line{'s' * (len(unreadable) > 1)}"
              f" {shown}); epsilon is read from its {len(records)} readable line(s)", file=sys.stderr)
    return records


def most_spent(records: list[dict]) -> float | None:
    """The largest ε any line records: what was released, whatever happened after."""
    spent = [float(r["epsilon"]) for r in records if r.get("epsilon") is not None]
    return max(spent) if spent else None


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "inf"
    return str(value)


def _noise(s: dict) -> str:
    """The closing table's noise row: the strategy, and correlated noise's bands and step-noise-matched rate."""
    if s["noise"] == "independent":
        return "independent"
    matched = s.get("lr_step_noise_matched")
    return (f"{s['noise']}, {s.get('bands')} bands over {s.get('noise_horizon')} steps"
            + (f" (lr {_fmt(s.get('lr'))}; step-noise-matched lr {_fmt(matched)})" if matched else ""))


def summary_table(s: dict) -> str:
    mem = s.get("peak_memory_bytes")
    fixed = s.get("noise_multiplier_fixed") is not None  # the target is the ε a fixed σ spends over the plan
    rows = [
        ("status", s.get("status")),
        ("method / model / data", f"{s.get('method')} / {s.get('model')} / {s.get('data')}"),
        ("steps done / planned", f"{s.get('steps_done')} / {s.get('steps')}"
         + (f" ({s['steps_released']} released by an earlier attempt)"
            if (s.get("steps_released") or 0) > (s.get("steps_done") or 0) else "")),
        ("epsilon spent / " + ("planned" if fixed else "target"),
         f"{_fmt(s.get('epsilon_spent'))} / {_fmt(s.get('epsilon_target'))} (delta {_fmt(s.get('delta'))}, sigma "
         f"{_fmt(s.get('sigma'))}{' fixed' if fixed else ''})"),
        *([("noise", _noise(s))] if s.get("noise") and s.get("epsilon_target") is not None else []),
        (f"{s.get('metric_name')} final / best", f"{_fmt(s.get('metric_final'))} / {_fmt(s.get('metric_best'))}"),
        ("peak memory", f"{mem / 2**20:.1f} MiB ({s.get('peak_memory_source')})" if mem else "-"),
        ("throughput", f"{_fmt(s.get('throughput_samples_per_s'))} samples/s"),
        ("wall time", f"{_fmt(s.get('wall_time_s'))} s"),
        ("run folder", s.get("run_dir")),
    ]
    if s.get("error"):
        rows.append(("error", s["error"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
