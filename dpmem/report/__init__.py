"""Turn records (memory plans, run summaries, benchmarks) into tables and figures."""

from pathlib import Path


def write_markdown(path, text: str) -> None:
    """Write a benchmark's markdown to `path` (folders made as needed) and print it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


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
