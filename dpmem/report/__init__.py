"""Turn records (memory plans, run summaries, benchmarks) into tables and figures."""

import functools
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30


def markdown_table(head: list[str], rows) -> list[str]:
    """A markdown table's lines: `head`, then each row of `rows` (its cells, as text)."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def write_markdown(path, text: str) -> None:
    """Write a benchmark's markdown to `path` (folders made as needed) and print it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


# -- benchmark pages (docs/benchmarks/): each measuring script under scripts/ writes its own -----------------------

def benchmark_page(script: str, name: str) -> Path:
    """docs/benchmarks/NAME.md of the checkout holding `script` (a scripts/ file's `__file__`), from whatever folder it
    runs. Notes the commit now, as the script starts: the code it measures (not an edit made while it runs)."""
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
    """How a benchmark page was made, so that its table cannot drift from the command that made it: the exact command
    (this process's arguments, quoted as a shell reads them), `device` (`machine`'s words), torch's version, dpmem's
    commit (`_commit`), the date, how long it took (since `started`, a `time.time()`), then `details` (the script's
    own settings)."""
    import torch

    command = " ".join(["python", f"scripts/{Path(sys.argv[0]).name}", *map(shlex.quote, sys.argv[1:])])
    commit = _commit(Path(sys.argv[0]).resolve().parent)
    facts = [f"Device: {device}", f"torch {torch.__version__}", commit and f"dpmem {commit}", time.strftime("%Y-%m-%d"),
             started is not None and f"took {_duration(time.time() - started)}"]
    text = f"Written by `{command}`. " + "; ".join(filter(None, facts)) + "."
    return text + (f" {details.strip()}" if details.strip() else "")


def page_header(title: str, device: str, details: str = "", started: float | None = None) -> str:
    """A benchmark page's title, then `provenance`'s paragraph."""
    return f"# {title}\n\n{provenance(device, details, started)}\n\n"


def _cpu_model() -> str | None:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):  # no /proc (not Linux), or no model name in it
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

    try:  # ":/" names dpmem/ and scripts/ at the checkout's top, whatever folder git runs in
        commit = git("rev-parse", "--short", "HEAD").strip()
        changed = git("status", "--porcelain", "--", ":/dpmem", ":/scripts").strip()
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
    names = [f"{name}.{ext}" for ext in formats]
    for file in names:
        fig.savefig(Path(folder) / file, dpi=120)
    pyplot().close(fig)
    return names
