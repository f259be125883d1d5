"""Subspace re-training (Li et al. 2022 (When Does DP Learning Not Suffer in High Dimensions?) §4.2, Fig. 2b):
each step's gradient is projected onto the top-k principal directions V_k found by `dpmem spectrum mode=trajectory`,
g ↦ V_k V_kᵀ g over the flattened trainable parameters: the clipped sums, before the noise (the paper's experiment),
or the privatised gradient (`method.subspace.where`, `dpmem.config.SubspaceWhere`).

Privacy (`privacy_of`, from the `source` the spectrum run stored in the file): a V_k made from the non-noised
clipped gradients of this same training set is a function of the private data, so the run is recorded as not
private (ε = ∞); one from another data set, or from privatised gradients, is public."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dpmem.config import ConfigError, enum_value
from dpmem.methods.privatize import Observer

def save_subspace(path: Path, names: list[str], shapes: list[tuple[int, ...]], basis: torch.Tensor,
                  values: torch.Tensor, source: dict) -> None:
    """The principal directions (p × K, orthonormal columns, strongest first) and where they came from."""
    torch.save({"names": names, "shapes": [list(s) for s in shapes], "basis": basis.to(torch.float32).cpu(),
                "values": values.cpu(), "source": source}, path)


def data_identity(data_cfg) -> dict:
    """What identifies the training data set: its name and local path (the sampling settings do not matter)."""
    return {"name": data_cfg.name, "path": data_cfg.get("path")}


def privacy_of(source: dict | None, data_cfg) -> tuple[bool, str]:
    """(private, why): may a subspace with this `source` be used by a private run on `data_cfg`?"""
    if not source:
        return False, "the subspace file records no source, so it may come from the private data"
    if source.get("noised"):
        return True, "the subspace is a function of already-privatised gradients"
    if source.get("data") != data_identity(data_cfg):
        return True, f"the subspace comes from another data set ({source.get('data')}), treated as public"
    return False, ("the subspace is computed from non-noised clipped gradients of this training set: it leaks "
                   "the private data, so this run is not private (epsilon = inf)")


class SubspaceProjection(Observer):
    """The projection, on the trainable parameters' gradients concatenated in the file's order."""

    def __init__(self, cfg, model: nn.Module):
        path = Path(cfg.path).expanduser()
        if not path.is_file():
            raise ConfigError("method.subspace.path", f"{path} is not a file; make one with dpmem spectrum "
                              "mode=trajectory (it writes subspace.pt)")
        stored = torch.load(path, map_location="cpu", weights_only=True)
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if sorted(stored["names"]) != sorted(named):
            extra = sorted(set(named) - set(stored["names"])) or sorted(set(stored["names"]) - set(named))
            raise ConfigError("method.subspace.path", f"{path} covers other parameters than this run trains "
                              f"(e.g. {extra[:2]}); train the same ones (model.trainable) as the spectrum run")
        basis = stored["basis"]
        k = cfg.k if cfg.k is not None else basis.shape[1]
        if not 1 <= k <= basis.shape[1]:
            raise ConfigError("method.subspace.k", f"{k}: allowed 1..{basis.shape[1]} (the directions stored)")
        self.where, self.k, self.source = enum_value(cfg.where), k, stored.get("source")
        self.order = [named[n] for n in stored["names"]]
        self.basis = basis[:, :k].to(device=self.order[0].device, dtype=self.order[0].dtype).contiguous()

    def on_clipped(self, privatizer, summed: dict) -> dict:
        return self(summed) if self.where == "clipped" else summed

    def on_noised(self, privatizer, released: dict) -> dict:
        return self(released) if self.where == "privatised" else released

    def __call__(self, grads: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        flat = self.basis @ (self.basis.T @ torch.cat([grads[p].reshape(-1) for p in self.order]))
        parts = flat.split([p.numel() for p in self.order])
        return {**grads, **{p: part.view_as(grads[p]) for p, part in zip(self.order, parts)}}
