"""Build a model from its config: a Hugging Face checkpoint (hub id or local path) or random init from an
architecture, so that random-init runs and memory planning need no download. `weights=False` always builds from
the architecture (memory planning: the shapes of a checkpoint without its weights)."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from dpmem.config import ConfigError
from dpmem.data import DataBundle


def _vit(cfg, data: DataBundle, weights: bool) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    if len(data.input_shape) != 3:
        raise ConfigError("model", "a ViT needs an image data set; this one gives token ids")
    channels, height, width = data.input_shape
    if height != width:
        raise ConfigError("data", f"ViT needs square images, got {height}x{width}")
    _heads(cfg, "classifier")
    if cfg.pretrained and weights:
        return _from_pretrained(ViTForImageClassification, cfg.pretrained, num_labels=data.num_classes,
                                ignore_mismatched_sizes=True)
    return ViTForImageClassification(ViTConfig(**_arch(cfg), image_size=height, num_channels=channels,
                                               num_labels=data.num_classes))


def _roberta(cfg, data: DataBundle, weights: bool) -> nn.Module:
    """RoBERTa with a sequence-classification head, or its masked-LM head (tied to the word embeddings) for
    prompt-based classification over label words."""
    from transformers import RobertaConfig, RobertaForMaskedLM, RobertaForSequenceClassification
    _text(cfg, data)
    cls = RobertaForMaskedLM if _heads(cfg, "classifier", "mlm") == "mlm" else RobertaForSequenceClassification
    if cfg.pretrained and weights:
        return _from_pretrained(cls, cfg.pretrained, num_labels=data.num_classes)
    return cls(RobertaConfig(**_arch(cfg), num_labels=data.num_classes))


def _causal(config_cls: str, model_cls: str):
    """A decoder-only LM (OPT, Llama) with its LM head, fine-tuned on next-token losses."""
    def build(cfg, data: DataBundle, weights: bool) -> nn.Module:
        import transformers
        _text(cfg, data)
        _heads(cfg, "causal")
        cls = getattr(transformers, model_cls)
        if cfg.pretrained and weights:
            return _from_pretrained(cls, cfg.pretrained)
        return cls(getattr(transformers, config_cls)(**_arch(cfg)))
    return build


def _text(cfg, data: DataBundle) -> None:
    if len(data.input_shape) != 1:
        raise ConfigError("model", f"{cfg.name} needs a text data set (token ids); with image data use a ViT "
                          "(model=vit-tiny), or data=synthetic for random token ids")


def _heads(cfg, *allowed: str) -> str:
    if cfg.head not in allowed:
        raise ConfigError("model.head", f"{cfg.head!r} is not a head of {cfg.family}; allowed: {', '.join(allowed)}")
    return cfg.head


def _arch(cfg) -> dict:
    if not cfg.arch:
        raise ConfigError("model.arch", f"{cfg.name} has no architecture to build without weights; set model.arch")
    return dict(cfg.arch)


def _from_pretrained(cls, name: str, **kwargs) -> nn.Module:
    local = Path(name).expanduser()
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    try:
        return cls.from_pretrained(str(local) if local.exists() else name, local_files_only=offline, **kwargs)
    except OSError as e:
        hint = " (HF_HUB_OFFLINE is set: only the local cache is searched)" if offline else ""
        raise ConfigError("model.pretrained", f"cannot load {name!r}{hint}: {str(e).splitlines()[0]}") from None


FAMILIES = {"vit": _vit, "roberta": _roberta, "opt": _causal("OPTConfig", "OPTForCausalLM"),
            "llama": _causal("LlamaConfig", "LlamaForCausalLM")}


def build_model(cfg, data: DataBundle, weights: bool = True) -> nn.Module:
    if cfg.family not in FAMILIES:
        raise ConfigError("model.family", f"{cfg.family!r} is unknown; allowed: {', '.join(FAMILIES)}")
    return FAMILIES[cfg.family](cfg, data, weights)
