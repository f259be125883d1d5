"""Turn records (memory plans, run summaries, benchmarks) into tables and figures."""

import functools
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path


def write_markdown(path, text: str) -> None:
    """Write a benchmark's markdown to `path` (folders made as needed) and print it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


# -- benchmark pages (docs/benchmarks/): each measuring script under scripts/ writes its own -----------------------

def benchmark_page(script: str, name: str) -> Path:
    """docs/benchmarks/NAME.md of the checkout that holds `script` (a file under scripts/, its `__file__`): where a
    measuring script writes its page by default, from whatever folder it is run. Notes the checkout's commit now,
    as the script starts: the code it measures (an edit made while it runs is not in the page's "local changes")."""
    _commit(Path(script).resolve().parent)
    return Path(script).resolve().parents[1] / "docs" / "benchmarks" / f"{name}.md"


def machine(device="cpu", threads: int | None = None) -> str:
    """Where a benchmark ran, in words: the CUDA device's name, or the CPU's model and torch's threads (`threads`,
    else torch's current setting); the meta device plans on the CPU and allocates nothing."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = _cpu_model()
    threads = threads if threads is not None else torch.get_num_threads()
    cpu = f"{f'CPU ({model})' if model else 'CPU'}, torch threads: {threads}"
    return f"meta (planned, nothing allocated) on a {cpu}" if device.type == "meta" else cpu


def provenance(device: str, details: str = "", started: float | None = None) -> str:
    """One paragraph saying how a benchmark page was made: the exact command (this process's arguments, quoted as a
    shell reads them), `device` (`machine`'s words), torch's version, dpmem's commit (with "+ local changes" where
    dpmem/ or scripts/ differ from it), the date, how long it took (since `started`, a `time.time()`), then
    `details` (the script's own settings)."""
    import torch

    command = " ".join(["python", f"scripts/{Path(sys.argv[0]).name}", *map(shlex.quote, sys.argv[1:])])
    facts = [f"Device: {device}", f"torch {torch.__version__}"]
    commit = _commit(Path(sys.argv[0]).resolve().parent)
    if commit:
        facts.append(f"dpmem {commit}")
    facts.append(time.strftime("%Y-%m-%d"))
    if started is not None:
        facts.append(f"took {_duration(time.time() - started)}")
    text = f"Written by `{command}`. " + "; ".join(facts) + "."
    return text + (f" {details.strip()}" if details.strip() else "")


def page_header(title: str, device: str, details: str = "", started: float | None = None) -> str:
    """The opening of a benchmark page: its title, then `provenance`'s paragraph. A table with its command, machine,
    torch version and date cannot drift from the command that made it."""
    return f"# {title}\n\n{provenance(device, details, started)}\n\n"


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or None


@functools.cache  # the first answer is kept: what the script started with (`benchmark_page`)
def _commit(folder: Path) -> str | None:
    """The checkout's short commit, "+ local changes" when dpmem/ or scripts/ differ from it, or None outside git.
    The environment's DPMEM_COMMIT comes first: a tree copied to a GPU machine may carry no .git, or one that is
    not the commit copied."""
    if os.environ.get("DPMEM_COMMIT"):
        return os.environ["DPMEM_COMMIT"]

    def git(*args):
        return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=30, check=True).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        top = Path(git("rev-parse", "--show-toplevel").strip())
        changed = subprocess.run(["git", "status", "--porcelain", "--", "dpmem", "scripts"], cwd=top,
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit} + local changes" if changed else commit or None


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, folder, name: str, formats=("png", "pdf")) -> list[str]:
    """`fig` as folder/name.FORMAT for each format, then closed; returns the file names."""
    fig.tight_layout()
    names = []
    for ext in formats:
        fig.savefig(Path(folder) / f"{name}.{ext}", dpi=120)
        names.append(f"{name}.{ext}")
    pyplot().close(fig)
    return names
