"""Tiny random-init Hugging Face models with a batch and a per-sample loss, for the tests."""

import torch
import torch.nn.functional as F


def tiny_roberta():
    from transformers import RobertaConfig, RobertaForMaskedLM
    cfg = RobertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=20, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=1, tie_word_embeddings=True)
    model = RobertaForMaskedLM(cfg)
    assert model.lm_head.decoder.weight is model.roberta.embeddings.word_embeddings.weight
    ids = torch.tensor([[0, 5, 6, 7, 8, 2], [0, 9, 10, 2, 1, 1], [0, 11, 2, 1, 1, 1]])
    mask = (ids != 1).long()
    labels = torch.full_like(ids, -100)
    labels[:, 2] = torch.tensor([12, 13, 14])
    labels[0, 4] = 15

    def loss(m, b):
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        return F.cross_entropy(logits.transpose(1, 2), b["labels"], reduction="none", ignore_index=-100).sum(1)
    return model, loss, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def tiny_vit(attn="sdpa"):
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=16, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=32, num_labels=4, attn_implementation=attn)
    model = ViTForImageClassification(cfg)
    x = torch.randn(3, 1, 8, 8)
    y = torch.tensor([0, 3, 1])

    def loss(m, b):
        return F.cross_entropy(m(pixel_values=b["pixel_values"]).logits, b["labels"], reduction="none")
    return model, loss, {"pixel_values": x, "labels": y}


def tiny_opt():
    from transformers import OPTConfig, OPTForCausalLM
    cfg = OPTConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
                    max_position_embeddings=16, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
                    pad_token_id=1)
    model = OPTForCausalLM(cfg)
    ids = torch.tensor([[1, 1, 2, 5, 6, 7], [2, 8, 9, 10, 11, 12], [1, 1, 1, 2, 13, 14]])  # left padding
    mask = (ids != 1).long()

    def loss(m, b):
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
        target = b["input_ids"][:, 1:].masked_fill(b["attention_mask"][:, 1:] == 0, -100)
        return F.cross_entropy(logits.transpose(1, 2), target, reduction="none", ignore_index=-100).sum(1)
    return model, loss, {"input_ids": ids, "attention_mask": mask}


def tiny_llama():
    """A causal Llama with a tied head and grouped-query attention (2 key/value heads for 4 query heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    ids = torch.tensor([[3, 5, 6, 7, 8, 9], [4, 9, 10, 11, 12, 13], [5, 11, 2, 14, 15, 16]])

    def loss(m, b):
        logits = m(input_ids=b["input_ids"]).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), b["input_ids"][:, 1:], reduction="none").sum(1)
    return model, loss, {"input_ids": ids}
