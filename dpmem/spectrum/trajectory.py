"""`dpmem spectrum mode=trajectory` (Li et al. 2022 (When Does DP Learning Not Suffer in High Dimensions?) §4.2,
App. B): during a private run, the averaged clipped (not noised) gradient ḡₜ = Σᵢ clip(gᵢ, C) / (q·n) of every step —
the privatised update less its noise — over the recorded parameters, written to disk in chunks of `spectrum.chunk` rows.
Afterwards the stacked r × p matrix H is analysed without ever being held (`analyse`, `dpmem.spectrum.linalg`); its
top directions are saved as subspace.pt for subspace re-training (`method.subspace.path`).

A run that dies keeps every full chunk and the partial one; `spectrum.gradients=FOLDER` analyses them again
(other k, iterations) without training."""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path

import torch

from dpmem.config import ConfigError
from dpmem.engine.summary import summary_table
from dpmem.engine.trainer import Run
from dpmem.methods import METHODS, method_class
from dpmem.methods.privatize import Observer
from dpmem.methods.subspace import data_identity, save_subspace
from dpmem.spectrum.linalg import orthogonal_iteration, power_law_slope, residual_norms
from dpmem.spectrum.not_private import mark_not_private


class GradientRecorder(Observer):
    """The privatizer's observer: flattens the recorded parameters' clipped mean gradient, keeps `chunk` rows in
    memory (float32, on the CPU) and writes each full chunk to `folder`/chunk_NNNNN.pt; index.json says what
    the rows are."""

    def __init__(self, folder: Path, patterns, chunk: int, source: dict):
        self.folder, self.patterns, self.chunk, self.source = Path(folder), patterns, chunk, source
        self.named: list[tuple[str, torch.nn.Parameter]] = []  # the recorded parameters, once attached
        self.rows: list[torch.Tensor] = []
        self.files: list[str] = []
        self.count = 0

    def attach(self, privatizer) -> None:
        self.named = recorded_parameters(privatizer.model, self.patterns)
        self.folder.mkdir(parents=True, exist_ok=True)

    def on_clipped(self, privatizer, summed: dict) -> dict:
        """One step's clipped sums; the row is their mean over the expected batch size, divided on the CPU copy."""
        batch = privatizer.mechanism.expected_batch_size
        self.rows.append(torch.cat([summed[p].detach().reshape(-1).float().cpu() for _, p in self.named]) / batch)
        self.count += 1
        if len(self.rows) == self.chunk:
            self.flush()
        return summed

    def flush(self) -> None:
        if self.rows:
            name = f"chunk_{len(self.files):05d}.pt"
            torch.save(torch.stack(self.rows), self.folder / name)
            self.files.append(name)
            self.rows = []
        index = {"names": [n for n, _ in self.named], "shapes": [list(p.shape) for _, p in self.named],
                 "p": sum(p.numel() for _, p in self.named), "rows": self.count, "files": self.files,
                 "source": self.source}
        (self.folder / "index.json").write_text(json.dumps(index, indent=1) + "\n")


def recorded_parameters(model, patterns) -> list[tuple[str, torch.nn.Parameter]]:
    """The trained (privatised) parameters, in model order, whose names match spectrum.params (all when None)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if patterns is not None:
        named = [(n, p) for n, p in named if any(fnmatch.fnmatch(n, pat) for pat in patterns)]
        if not named:
            raise ConfigError("spectrum.params", f"{list(patterns)} match no trained parameter; names look like "
                              f"{', '.join(n for n, _ in list(model.named_parameters())[:3])}")
    return named


def record(cfg, out: Path) -> tuple[Run, Path]:
    """Run the configured private training with a GradientRecorder on its privatizer; returns the run (its
    summary says how it ended) and the gradients folder."""
    if not method_class(cfg.method.name).spec.privatised_gradient:
        allowed = ", ".join(n for n, c in METHODS.items() if c.spec.privatised_gradient)
        raise ConfigError("method.name", f"{cfg.method.name} has no full clipped gradient to record; allowed: "
                          f"{allowed}")
    folder = out / "gradients"
    recorder = GradientRecorder(folder, cfg.spectrum.params, cfg.spectrum.chunk,
                                source={"data": data_identity(cfg.data), "noised": False, "run_dir": str(out)})
    run = Run(cfg, out, observers=(recorder,))
    run.prepare()
    mark_not_private(run, "trajectory")
    try:
        run.execute()
    finally:
        recorder.flush()
    print(summary_table(run.summary), file=sys.stderr)
    return run, folder


def analyse(folder: Path, sp, out: Path, device: torch.device | str = "cpu") -> dict:
    """PCA of the recorded gradients in `folder` (float32, the p × k matrices on `device`); writes subspace.pt to
    `out` and returns the numbers."""
    index_file = Path(folder) / "index.json"
    if not index_file.is_file():
        raise ConfigError("spectrum.gradients", f"{index_file} not found: point at the gradients/ folder (or the "
                          "run folder) of a mode=trajectory run")
    index = json.loads(index_file.read_text())
    if index["rows"] == 0:
        raise ConfigError("spectrum.gradients", f"{folder} holds no recorded gradient (the run took no step)")

    def rows():  # a fresh pass over the chunks
        return (torch.load(Path(folder) / f, weights_only=True) for f in index["files"])
    k = min(sp.k, index["p"])  # beyond the r recorded rows the directions have σ = 0
    gen = torch.Generator().manual_seed(sp.seed)
    values, basis = orthogonal_iteration(rows, index["p"], k, sp.iterations, gen, torch.float32, device)
    slope, intercept = power_law_slope(values.cpu())
    ks = sorted({0, *[k_ for k_ in sp.ks if k_ <= k]})
    g_k = residual_norms(rows, basis, ks)
    save_subspace(out / "subspace.pt", index["names"], index["shapes"], basis, values, index["source"])
    return {"mode": "trajectory", "rows": index["rows"], "p": index["p"], "k": k, "iterations": sp.iterations,
            "singular_values": values.cpu().tolist(), "slope": slope, "intercept": intercept,
            "G_k": {str(k_): v for k_, v in g_k.items()}, "parameters": index["names"],
            "gradients": str(folder), "subspace": str(out / "subspace.pt")}
