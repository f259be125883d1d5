"""Image classification: arrays to normalised tensors, a fixed stratified split, and per-sample losses."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.model_selection import train_test_split

from dpmem.data.bundle import DataBundle


def image_bundle(x_train, y_train, x_test=None, y_test=None, *, test_fraction: float, split_seed: int,
                 scale: float, num_classes: int | None = None) -> DataBundle:
    """x: (N, H, W) or (N, C, H, W) with values in [0, scale]; y: integer labels (classes: `num_classes`, or the
    largest label + 1). Without a test split, a stratified `test_fraction` is held out with `split_seed`, so the
    split does not change with train.seed."""
    if x_test is None:
        x_train, x_test, y_train, y_test = train_test_split(
            x_train, y_train, test_size=test_fraction, random_state=split_seed, stratify=y_train)

    def images(x):
        x = torch.as_tensor(np.asarray(x), dtype=torch.float32)
        x = x.unsqueeze(1) if x.dim() == 3 else x
        return (x / scale - 0.5) / 0.5

    y_all = np.concatenate([np.asarray(y_train), np.asarray(y_test)])
    train = {"pixel_values": images(x_train), "labels": torch.as_tensor(np.asarray(y_train), dtype=torch.long)}
    test = {"pixel_values": images(x_test), "labels": torch.as_tensor(np.asarray(y_test), dtype=torch.long)}
    return DataBundle(train, test, num_classes=num_classes or int(y_all.max()) + 1,
                      input_shape=tuple(train["pixel_values"].shape[1:]),
                      per_sample_loss=per_sample_loss, predict=predict)


def per_sample_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(pixel_values=at_model_size(model, batch["pixel_values"])).logits
    return F.cross_entropy(logits.float(), batch["labels"], reduction="none")


def predict(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(pixel_values=at_model_size(model, batch["pixel_values"])).logits.argmax(-1)


def at_model_size(model, x: torch.Tensor) -> torch.Tensor:
    """Images resized (bilinear) to the model's input size, batch by batch: a 224×224 checkpoint fine-tuned on
    32×32 CIFAR images (DP-GRAPE App. C.1) would need 30 GB to store CIFAR-10 at 224×224."""
    size = getattr(getattr(model, "config", None), "image_size", None)
    if size is None or tuple(x.shape[-2:]) == (size, size):
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
