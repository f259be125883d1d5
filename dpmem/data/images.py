"""Image classification: arrays to normalised tensors, a fixed stratified split, and per-sample losses."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dpmem.config import ConfigError
from dpmem.data.bundle import DataBundle

CHANNELS = (1, 3, 4)  # grey, RGB, RGBA


def value_scale(where: str, x: np.ndarray) -> tuple[float, str]:
    """The range images' values are read in: 0..255 (integers, or floats beyond 1) or 0..1 (floats), and a line
    that says which was assumed. Values outside both (negative, above 255) are refused. Raises ConfigError."""
    low, high, floats = float(x.min()), float(x.max()), np.issubdtype(x.dtype, np.floating)
    if low < 0 or high > 255:
        raise ConfigError("data.path", f"{where}: image values run from {low:g} to {high:g}; allowed: 0..255 "
                          "(integers, 255 = white) or 0..1 (floats, 1 = white)")
    if floats and high <= 1:
        return 1.0, f"{where}: float images in 0..1 (max {high:g}), read with 1 = white"
    return 255.0, f"{where}: {'float' if floats else 'integer'} images in 0..255 (max {high:g}), read with 255 = white"


def image_bundle(x_train, y_train, x_test=None, y_test=None, *, test_fraction: float, split_seed: int,
                 scale: float, num_classes: int | None = None) -> DataBundle:
    """x: (N, H, W), (N, C, H, W) or (N, H, W, C) with values in [0, scale] (where both of the last two readings are
    possible, a second and last dimension of 1, 3 or 4: channels first); y: integer labels (classes: `num_classes`,
    or the largest label + 1). Without a test split, a stratified `test_fraction` is held out with `split_seed`, so
    the split does not change with train.seed."""
    if x_test is None:
        from sklearn.model_selection import train_test_split  # only this split needs sklearn
        classes, counts = np.unique(np.asarray(y_train), return_counts=True)
        if counts.min() < 2:
            small = ", ".join(f"class {c} has {n} example" for c, n in zip(classes, counts) if n < 2)
            raise ConfigError("data.path", f"{small}: the held-out split "
                              f"(data.test_fraction={test_fraction:g}) is stratified and needs 2 of each class; add "
                              "examples, drop the class, or give x_test and y_test")
        try:
            x_train, x_test, y_train, y_test = train_test_split(
                x_train, y_train, test_size=test_fraction, random_state=split_seed, stratify=y_train)
        except ValueError as e:  # a split too small to hold every class once
            raise ConfigError("data.test_fraction", f"{test_fraction:g} of {len(y_train)} examples cannot hold each "
                              f"of the {len(classes)} classes on both sides of the stratified split "
                              f"({str(e).splitlines()[0]}); allowed: a fraction that leaves each side at least "
                              f"{len(classes)} examples, or give x_test and y_test") from None

    def columns(x, y) -> dict[str, torch.Tensor]:
        x = np.asarray(x)
        if x.ndim == 3:
            x = x[:, None]
        elif x.shape[3] in CHANNELS and x.shape[1] not in CHANNELS:  # (N, H, W, C): numpy's and PIL's layout
            x = x.transpose(0, 3, 1, 2)
        return {"pixel_values": (torch.as_tensor(x, dtype=torch.float32) / scale - 0.5) / 0.5,
                "labels": torch.as_tensor(np.asarray(y), dtype=torch.long)}

    train, test = columns(x_train, y_train), columns(x_test, y_test)
    classes = num_classes or int(np.concatenate([np.asarray(y_train), np.asarray(y_test)]).max()) + 1
    return DataBundle(train, test, num_classes=classes, input_shape=tuple(train["pixel_values"].shape[1:]),
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
