"""Build a model from its config: a Hugging Face checkpoint (hub id or local path) or random init from an
architecture, so that random-init runs and memory planning need no download. `weights=False` always builds from
the architecture (memory planning: the shapes of a checkpoint without its weights)."""

from __future__ import annotations

import contextlib
import fnmatch
from pathlib import Path
from typing import Callable, ContextManager

from torch import nn

from dpmem.config import ConfigError
from dpmem.data import DataBundle
from dpmem.metering import memory_label
from dpmem.models.lora import apply_lora
from dpmem.sources import fetching, resolve_source, why_not_loaded
from dpmem.sources import offline as downloads_off


def _vit(cfg, data: DataBundle, weights: bool) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    if len(data.input_shape) != 3:
        raise ConfigError("model", "a ViT needs an image data set; this one gives token ids")
    channels, height, width = data.input_shape
    if height != width:
        raise ConfigError("data", f"ViT needs square images; these are (C, H, W) = {tuple(data.input_shape)}")
    _heads(cfg, "classifier")
    if cfg.pretrained and weights:
        return _from_pretrained(ViTForImageClassification, cfg.pretrained, num_labels=data.num_classes,
                                ignore_mismatched_sizes=True)
    arch = {"image_size": height, **_arch(cfg)}  # a checkpoint's size (arch.image_size) wins: batches are resized
    return ViTForImageClassification(ViTConfig(**arch, num_channels=channels, num_labels=data.num_classes))


# the text families: their transformers config class, and the model class of each head they have (how each head is
# trained: dpmem.data.text). BERT (e.g. all-MiniLM-L6-v2) classifies on its pooled output.
TEXT = {"roberta": ("RobertaConfig", {"classifier": "RobertaForSequenceClassification", "mlm": "RobertaForMaskedLM"}),
        "bert": ("BertConfig", {"classifier": "BertForSequenceClassification"}),
        "opt": ("OPTConfig", {"causal": "OPTForCausalLM"}), "llama": ("LlamaConfig", {"causal": "LlamaForCausalLM"})}


def _text(cfg, data: DataBundle, weights: bool) -> nn.Module:
    import transformers
    if len(data.input_shape) != 1:
        raise ConfigError("model", f"{cfg.name} needs a text data set (token ids); with image data use a ViT "
                          "(model=vit-tiny), or data=synthetic for random token ids")
    config_cls, heads = TEXT[cfg.family]
    cls = getattr(transformers, heads[_heads(cfg, *heads)])
    labels = {} if cfg.head == "causal" else {"num_labels": data.num_classes}
    if cfg.pretrained and weights:
        model = _from_pretrained(cls, cfg.pretrained, **labels)
    else:
        model = cls(getattr(transformers, config_cls)(**_arch(cfg), **labels))
    return model


def _heads(cfg, *allowed: str) -> str:
    if cfg.head not in allowed:
        raise ConfigError("model.head", f"{cfg.head!r} is not a head of {cfg.family}; allowed: {', '.join(allowed)}")
    return cfg.head


def _arch(cfg) -> dict:
    if not cfg.arch:
        raise ConfigError("model.arch", f"{cfg.name} has no architecture to build without weights; set model.arch")
    return dict(cfg.arch)


def _from_pretrained(cls, name: str, **kwargs) -> nn.Module:
    from dpmem.models.hub import model_type_of
    expected = cls.config_class.model_type
    found = model_type_of(name)
    if found != expected:  # loaded anyway, every weight would be missing (random init, transformers' warning only)
        raise ConfigError("model.pretrained", f"{name!r} is a {found} checkpoint, not {expected} (this model's "
                          f"family); load it with model=auto model.pretrained={name}")
    offline = downloads_off()
    source = resolve_source(name, "model.pretrained")  # a local path that does not exist is said so here
    unreachable = None if offline or Path(source).exists() else fetching(f"the model {name}")
    try:
        return cls.from_pretrained(source, local_files_only=offline or unreachable is not None, **kwargs)
    except OSError as e:
        hint = " (offline: only the local cache is searched)" if offline else ""
        raise ConfigError("model.pretrained", f"cannot load {name!r}{hint}: {why_not_loaded(unreachable, e)}") \
            from None


def _median(cfg, data: DataBundle, weights: bool) -> nn.Module:
    """β of the generalized geometric median: its dimension and metric are the data set's (data=median)."""
    from dpmem.models.median import GeometricMedian
    if data.problem is None or "A" not in data.problem:
        raise ConfigError("data", "model=median is the vector β of data=median; choose data=median")
    return GeometricMedian(data.problem["A"], data.problem["alpha"])


def _auto(cfg, data: DataBundle, weights: bool) -> nn.Module:
    from dpmem.models.hub import build_auto
    return build_auto(cfg, data, weights)


FAMILIES = {"vit": _vit, **dict.fromkeys(TEXT, _text), "median": _median, "auto": _auto}


def build_model(cfg, data: DataBundle, weights: bool = True) -> nn.Module:
    if cfg.family not in FAMILIES:
        raise ConfigError("model.family", f"{cfg.family!r} is unknown; allowed: {', '.join(FAMILIES)}")
    return _freeze(cfg.get("frozen"), _freeze_all_but(cfg.trainable, apply_lora(cfg, FAMILIES[cfg.family](
        cfg, data, weights))))


def checkpoint_activations(model: nn.Module, recompute: Callable[[], ContextManager] | None = None,
                           compiled: bool = False) -> nn.Module:
    """train.activation_checkpointing: keep only each block's input in the forward pass and recompute the block
    in the backward (Hugging Face's gradient checkpointing, non-reentrant: the recompute runs inside the backward,
    so dpmem's per-sample taps save their layer inputs again there; see dpmem.persample.taps). Only in training
    mode, as Hugging Face applies it. The recompute runs inside `recompute()` (the memory planner's attention
    kernels: a mode entered around the forward is off in the backward pass), and its tensors count as
    activations. `compiled` (train.compile): the forward is compiled, and AOTAutograd's partitioner recomputes the
    blocks; dynamo takes no context there but two dispatch modes, and refuses Hugging Face's hook that makes the
    embeddings' output require grad (reentrant checkpointing's need, not this one's)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError("train.activation_checkpointing", f"{type(model).__name__} does not support gradient "
                          "checkpointing")

    def contexts():
        return contextlib.nullcontext(), _Recomputing(recompute)
    kwargs = {"use_reentrant": False, **({} if compiled else {"context_fn": contexts})}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the older name is deprecated
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if compiled:
        model.disable_input_require_grads()
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # a key/value cache is for generation, and is refused with checkpointing
    return model


def checkpointed(model: nn.Module) -> bool:
    """Whether `checkpoint_activations` applies to the model (its blocks recompute in the backward pass)."""
    name = "is_activation_checkpointing" if hasattr(model, "activation_checkpointing_enable") else \
        "is_gradient_checkpointing"  # transformers >= 5.x renamed it
    return bool(getattr(model, name, False))


class _Recomputing:
    """The context of a checkpoint's recompute; entered once per backward pass through the block (two-pass
    clipping recomputes twice), so each entry opens its own stack."""

    def __init__(self, recompute: Callable[[], ContextManager] | None):
        self.recompute, self.stacks = recompute, []

    def __enter__(self):
        stack = contextlib.ExitStack()
        stack.enter_context(memory_label("activations"))
        if self.recompute is not None:
            stack.enter_context(self.recompute())
        self.stacks.append(stack)

    def __exit__(self, *exc):
        return self.stacks.pop().__exit__(*exc)


def _freeze_all_but(patterns, model: nn.Module) -> nn.Module:
    """Train only the parameters whose names match `patterns` (of those trainable so far); None: leave as is."""
    if patterns is None:
        return model
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    keep = {n for n, _ in named if any(fnmatch.fnmatch(n, pattern) for pattern in patterns)}
    if not keep:
        raise ConfigError("model.trainable", f"{list(patterns)} match no trainable parameter; names look like "
                          f"{', '.join(n for n, _ in named[:3])}, …, {named[-1][0]}")
    for n, p in named:
        p.requires_grad_(n in keep)
    return model


def _freeze(patterns, model: nn.Module) -> nn.Module:
    """model.frozen: the trainable parameters whose names match `patterns` frozen; a pattern that matches none of
    them is refused (a misspelt name would leave the layer it meant trained)."""
    if not patterns:
        return model
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for pattern in patterns:
        if not any(fnmatch.fnmatch(n, pattern) for n, _ in named):
            shown = f"{', '.join(n for n, _ in named[:3])}, …, {named[-1][0]}" if named else "none is trainable"
            raise ConfigError("model.frozen", f"{pattern!r} matches no trainable parameter; names look like {shown}")
    for n, p in named:
        if any(fnmatch.fnmatch(n, pattern) for pattern in patterns):
            p.requires_grad_(False)
    return model
