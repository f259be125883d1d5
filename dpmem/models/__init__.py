"""Build a model from its config: a Hugging Face checkpoint (hub id or local path) or random init from an
architecture, so that random-init runs and memory planning need no download."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from dpmem.config import ConfigError
from dpmem.data import DataBundle


def _vit(cfg, data: DataBundle) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    if len(data.input_shape) != 3:
        raise ConfigError("model", "a ViT needs an image data set; this one gives token ids")
    channels, height, width = data.input_shape
    if height != width:
        raise ConfigError("data", f"ViT needs square images, got {height}x{width}")
    if cfg.pretrained:
        return _from_pretrained(ViTForImageClassification, cfg.pretrained, num_labels=data.num_classes,
                                ignore_mismatched_sizes=True)
    arch = dict(cfg.arch)
    return ViTForImageClassification(ViTConfig(**arch, image_size=height, num_channels=channels,
                                               num_labels=data.num_classes))


def _roberta(cfg, data: DataBundle) -> nn.Module:
    """RoBERTa with a sequence-classification head (random init from `arch`, or a checkpoint)."""
    from transformers import RobertaConfig, RobertaForSequenceClassification
    if len(data.input_shape) != 1:
        raise ConfigError("model", "RoBERTa needs a text data set (token ids); with image data use model=vit-tiny")
    if cfg.pretrained:
        return _from_pretrained(RobertaForSequenceClassification, cfg.pretrained, num_labels=data.num_classes)
    return RobertaForSequenceClassification(RobertaConfig(**dict(cfg.arch), num_labels=data.num_classes))


def _from_pretrained(cls, name: str, **kwargs) -> nn.Module:
    local = Path(name).expanduser()
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    try:
        return cls.from_pretrained(str(local) if local.exists() else name, local_files_only=offline, **kwargs)
    except OSError as e:
        hint = " (HF_HUB_OFFLINE is set: only the local cache is searched)" if offline else ""
        raise ConfigError("model.pretrained", f"cannot load {name!r}{hint}: {str(e).splitlines()[0]}") from None


FAMILIES = {"vit": _vit, "roberta": _roberta}


def build_model(cfg, data: DataBundle) -> nn.Module:
    if cfg.family not in FAMILIES:
        raise ConfigError("model.family", f"{cfg.family!r} is unknown; allowed: {', '.join(FAMILIES)}")
    return FAMILIES[cfg.family](cfg, data)
