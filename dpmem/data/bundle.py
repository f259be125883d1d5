"""A data set in memory: its columns, the task that turns a batch into per-sample losses, and the metric."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from dpmem.config import ConfigError


@dataclass
class DataBundle:
    train: dict[str, torch.Tensor]  # columns, first dimension = examples
    test: dict[str, torch.Tensor]  # the evaluated split (data.eval_split)
    num_classes: int  # 0 for generation tasks
    input_shape: tuple[int, ...]  # of one example's model input
    per_sample_loss: Callable  # (model, batch) -> losses of shape (B,)
    predict: Callable  # (model, batch) -> predicted labels, for the accuracy metric
    metric_name: str = "accuracy"
    # (model, device, batch_size, autocast) -> the metric on `test`, or a dict of metrics (metric_name's among them);
    # None = accuracy of `predict` on test["labels"]
    score: Optional[Callable] = None
    # (model, batch, **generate options) -> generated ids: a generation task's work on one batch of `test`, which
    # `score` runs per batch (and the memory planner on meta); None for tasks that do not generate
    generate: Optional[Callable] = None
    # right-padded token columns: a batch drops the padding all its examples share (same losses, less compute)
    trim_padding: bool = False
    problem: Optional[dict] = None  # what a model built for this data set takes from it (data=median: A, alpha)
    # who wrote each training record (int64 ids, dpmem.data.users): data.columns.user or data.users; None = unknown
    users: Optional[torch.Tensor] = None

    @property
    def higher_is_better(self) -> bool:
        return not is_loss(self.metric_name)

    @property
    def n_train(self) -> int:
        return len(next(iter(self.train.values())))

    def batch(self, columns: dict[str, torch.Tensor], index, trim: bool = True) -> dict[str, torch.Tensor]:
        """The examples `index` (a tensor of indices or a slice) of `columns` (train or test); `trim=False` keeps
        the split's full width (train.static_shapes: every batch one shape)."""
        out = {k: v[index] for k, v in columns.items()}
        mask = out.get("attention_mask")
        if trim and self.trim_padding and mask is not None and len(mask):
            width = int(mask.sum(1).max())
            out = {k: v[:, :width] if v.dim() == 2 and v.shape[1] == mask.shape[1] else v for k, v in out.items()}
        return out


def is_loss(metric_name) -> bool:
    """The metric's direction and form, by its name: a loss (data=median's excess losses) is better lower and is
    shown as it is; the others (accuracy, F1, EM, ROUGE-1) are fractions, better higher, shown in %."""
    return str(metric_name).endswith("loss")


def check_class_numbers(where: str, labels, other_way: str = "") -> None:
    """Integer labels number the classes 0..C-1, with no more classes than examples: a label far out of range would
    size the model's head (C = the largest label + 1). Raises ConfigError naming `where`."""
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= len(labels):
        raise ConfigError("data.path", f"{where}: labels run from {low} to {high}"
                          + (" (negative labels are no class)" if low < 0 else "")
                          + f", which would make {high + 1} classes for {len(labels)} examples; number the classes "
                          f"0..C-1{other_way}")


def check_classes(data: DataBundle, key: str, where: str) -> None:
    """A classification training set holds at least two classes: with one, every prediction is that class and
    accuracy is 1.0 whatever was learnt. Raises ConfigError naming `key`."""
    labels = data.train.get("labels")
    if (data.num_classes > 0 and labels is not None and labels.dim() == 1 and len(labels)
            and labels.device.type != "meta"):  # a plan's shapes-only data holds no labels
        present = torch.unique(labels)
        if len(present) < 2:
            raise ConfigError(key, f"{where}: every training label is {int(present[0])}: a classifier needs at "
                              "least 2 classes (with one, any model scores accuracy 1.0)")


class Padded(dict):
    """A micro-batch of `real` samples followed by padding ones that weigh 0: train.static_shapes' full-size
    micro-batches, and under FSDP a rank's padding micro-batches (real = 0), run only so that its collectives pair
    with the other ranks'. A dict of the batch's columns, so a loss function sees nothing else; `weights` (B,) are
    1 for the real samples, 0 for the padding."""

    def __init__(self, columns: dict[str, torch.Tensor], real: int):
        super().__init__(columns)
        self.real = real
        rows = next(iter(columns.values()))
        self.weights = (torch.arange(len(rows), device=rows.device) < real).float()


class Grouped(dict):
    """A micro-batch of users' records (ULS, privacy.unit=user): k slots to a user, user after user, each slot a
    record of that user or empty (`present` 0: a copy of some record whose loss weighs 0, so its gradient is 0).
    What is clipped is a user's summed gradient: `weights` (U,) are 1 for a sampled user, 0 for a padding one
    (train.static_shapes, FSDP's padding micro-batches)."""

    def __init__(self, columns: dict[str, torch.Tensor], k: int, present: torch.Tensor, device=None):
        """`present` (U·k,) on the host (the real users counted there, without a sync), moved to `device`."""
        super().__init__(columns)
        users = present.view(-1, k).amax(1)  # a user with no record is padding
        self.k, self.real = k, int(users.sum())
        self.present, self.weights = present.to(device), users.to(device)


def weights(batch: dict[str, torch.Tensor]) -> torch.Tensor | float:
    """How much each clipped unit of a micro-batch counts in the step (its clip factor, its loss): a `Padded` one's
    weights per sample, a `Grouped` one's per user, else 1."""
    return batch.weights if isinstance(batch, (Padded, Grouped)) else 1.0


def real_size(batch: dict[str, torch.Tensor]) -> int:
    """The clipped units of a micro-batch that count (weigh 1: samples, or a `Grouped` one's users), known on the
    host."""
    return batch.real if isinstance(batch, (Padded, Grouped)) else len(next(iter(batch.values())))
