"""Text tasks on token ids. How a batch becomes per-sample losses depends on the model's head:

- a sequence-classification head: cross-entropy of its logits;
- a masked-LM head (prompt-based fine-tuning, as LM-BFF and MeZO): the LM head is applied at the mask position
  only (column `mask_pos`) and its logits over the label words are the class logits;
- a causal LM: the next-token loss over the sequence (mean over attended positions), as when fine-tuning on
  answers or label continuations; the class prediction scores the label words after the last token.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def task(head: str, label_word_ids: list[int]) -> tuple[Callable, Callable]:
    """(per_sample_loss, predict) for a model with this head: classifier | mlm | causal."""
    words = torch.tensor(label_word_ids, dtype=torch.long)

    def class_logits(model, batch):
        if head == "classifier":
            return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        if head == "mlm":
            hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))[0]
            at_mask = hidden[torch.arange(hidden.shape[0], device=hidden.device), batch["mask_pos"]]
            return model.lm_head(at_mask)[:, words.to(hidden.device)]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        return logits[:, -1, words.to(logits.device)]

    def per_sample_loss(model, batch):
        if head != "causal":
            return F.cross_entropy(class_logits(model, batch).float(), batch["labels"], reduction="none")
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        target = ids[:, 1:] if mask is None else ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        losses = F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none", ignore_index=-100)
        return losses.sum(1) / (target != -100).sum(1).clamp(min=1)

    def predict(model, batch):
        return class_logits(model, batch).argmax(-1)

    return per_sample_loss, predict
