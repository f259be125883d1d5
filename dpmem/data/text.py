"""Sequence classification on token ids: per-sample losses and predictions from a model's logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_sample_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    return F.cross_entropy(logits.float(), batch["labels"], reduction="none")


def predict(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits.argmax(-1)
