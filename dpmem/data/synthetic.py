"""Random inputs of a given shape: for memory planning (`dpmem memory`) and throughput runs on any model.
Images (channels × image_size²) for image models, token ids (seq_len) for text models; labels are random, so
there is nothing to learn. No attention mask: every token is attended, as in a batch without padding."""

from __future__ import annotations

import torch

from dpmem.config import ConfigError
from dpmem.data.bundle import DataBundle
from dpmem.data import images, text


def load(cfg, model_cfg) -> DataBundle:
    gen = torch.Generator().manual_seed(cfg.split_seed)
    if not cfg.n_train or cfg.n_train < 1:
        raise ConfigError("data.n_train", f"{cfg.n_train}: synthetic data needs a positive number of examples")
    n, n_test, classes = cfg.n_train, max(1, round(cfg.n_train * cfg.test_fraction)), cfg.num_classes
    if classes < 2:
        raise ConfigError("data.num_classes", f"{classes} must be >= 2")
    hub = None
    if model_cfg.family == "auto":  # the checkpoint's config says image or text, and its vocabulary
        from dpmem.models.hub import checkpoint_config, is_image
        hub = checkpoint_config(model_cfg)
    if model_cfg.family == "vit" or (hub is not None and is_image(hub)):
        shape = (getattr(hub, "num_channels", cfg.channels), getattr(hub, "image_size", cfg.image_size),
                 getattr(hub, "image_size", cfg.image_size))

        def columns(m):
            return {"pixel_values": torch.randn(m, *shape, generator=gen),
                    "labels": torch.randint(0, classes, (m,), generator=gen)}
        return DataBundle(columns(n), columns(n_test), classes, shape, images.per_sample_loss, images.predict)
    vocab = model_cfg.arch.get("vocab_size") or getattr(hub, "vocab_size", None)
    positions = getattr(hub, "max_position_embeddings", getattr(hub, "n_positions", None))
    if positions is not None and cfg.seq_len > positions:
        raise ConfigError("data.seq_len", f"{cfg.seq_len} tokens exceed the {positions} positions of "
                          f"{model_cfg.pretrained}; set data.seq_len to at most {positions}")
    if not vocab:
        raise ConfigError("model.arch.vocab_size", "synthetic text needs the model's vocabulary size")
    if vocab < classes + 3:
        raise ConfigError("data.num_classes", f"{classes} label words do not fit a vocabulary of {vocab}")
    head = model_cfg.head
    label_words = list(range(vocab - classes, vocab))  # the last ids: never special tokens
    # an encoder-decoder classifier (T5's) reads each sequence at its end-of-sequence token, which its tokenizer
    # appends: so does this
    eos = getattr(hub, "eos_token_id", None) if getattr(hub, "is_encoder_decoder", False) else None

    def columns(m):
        ids = torch.randint(3, vocab - classes, (m, cfg.seq_len), generator=gen)
        if eos is not None and head == "classifier":
            ids[:, -1] = eos
        return {"input_ids": ids, "labels": torch.randint(0, classes, (m,), generator=gen),
                "mask_pos": torch.full((m,), cfg.seq_len - 1)}  # the mlm head reads the last position
    loss, predict = text.task(head, label_words, generative=head == "causal")  # causal: LM loss
    return DataBundle(columns(n), columns(n_test), classes, (cfg.seq_len,), loss, predict)
