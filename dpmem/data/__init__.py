"""Data sets as in-memory column tensors, with the task that turns a batch into per-sample losses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dpmem.config import ConfigError


@dataclass
class DataBundle:
    train: dict[str, torch.Tensor]  # columns, first dimension = examples
    test: dict[str, torch.Tensor]
    num_classes: int
    input_shape: tuple[int, ...]  # of one example's model input
    per_sample_loss: Callable  # (model, batch) -> losses of shape (B,)
    predict: Callable  # (model, batch) -> predicted labels, for the accuracy metric
    metric_name: str = "accuracy"

    @property
    def n_train(self) -> int:
        return len(next(iter(self.train.values())))


def take(columns: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[index] for k, v in columns.items()}


def build_data(cfg, model_cfg) -> DataBundle:
    """The data set of `cfg`; synthetic data takes its kind (images or token ids) from the model."""
    from dpmem.data import digits, npz, synthetic
    loaders = {"digits": digits.load, "npz": npz.load, "synthetic": lambda c: synthetic.load(c, model_cfg)}
    if cfg.name not in loaders:
        raise ConfigError("data.name", f"{cfg.name!r} is unknown; allowed: {', '.join(loaders)}")
    return loaders[cfg.name](cfg)


def example_batch(data: DataBundle, size: int, device) -> dict[str, torch.Tensor]:
    """A batch of `size` copies of the first training example on `device` (meta: shapes only), for planning."""
    return {k: v[:1].expand(size, *v.shape[1:]).contiguous().to(device) for k, v in data.train.items()}
