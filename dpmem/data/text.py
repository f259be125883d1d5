"""Text tasks on token ids. How a batch becomes per-sample losses depends on the model's head:

- a sequence-classification head: cross-entropy of its logits;
- a masked-LM head (prompt-based fine-tuning, as LM-BFF and MeZO): the LM head is applied at the mask position
  only (column `mask_pos`) and its logits over the label words are the class logits;
- a causal LM classifying (MeZO's train-as-classification): the LM head's logits over the label words at the
  prompt's last token (`mask_pos`) are the class logits;
- a causal LM generating: the next-token loss, mean over the answer's tokens (`target_mask`) or, without one,
  over every attended token."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def task(head: str, label_word_ids: list[int], generative: bool = False) -> tuple[Callable, Callable]:
    """(per_sample_loss, predict) for a model with this head: classifier | mlm | causal (generative: LM loss)."""
    words = torch.tensor(label_word_ids, dtype=torch.long)

    def class_logits(model, batch):
        if head == "classifier":
            return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        # mlm and causal: the LM head only where the class is read, not over every position (a causal LM's full
        # B×T×V logits would be the largest activation of a long-context run)
        hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))[0]
        at_slot = hidden[torch.arange(hidden.shape[0], device=hidden.device), batch["mask_pos"]]
        return model.lm_head(at_slot)[:, words.to(hidden.device)]

    def per_sample_loss(model, batch):
        if not generative:
            return F.cross_entropy(class_logits(model, batch).float(), batch["labels"], reduction="none")
        ids, mask = batch["input_ids"], batch.get("target_mask", batch.get("attention_mask"))
        logits = model(input_ids=ids, attention_mask=batch.get("attention_mask")).logits[:, :-1]
        target = ids[:, 1:] if mask is None else ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        losses = F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none", ignore_index=-100)
        return losses.sum(1) / (target != -100).sum(1).clamp(min=1)

    def predict(model, batch):
        return class_logits(model, batch).argmax(-1)

    return per_sample_loss, predict
