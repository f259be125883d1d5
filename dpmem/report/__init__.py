"""Turn records (memory plans, run summaries, benchmarks) into tables and figures."""

from pathlib import Path


def write_markdown(path, text: str) -> None:
    """Write a benchmark's markdown to `path` (folders made as needed) and print it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
