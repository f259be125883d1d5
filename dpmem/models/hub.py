"""model=auto (model.family=auto): any Hugging Face checkpoint, a hub id or a local folder, built by the Auto class of
its head from the checkpoint's own config, so that its architecture needs no dpmem config and `dpmem memory` and
`dpmem plan` build it on the meta device from config.json alone, without weights. The attribution proof
(`dpmem.methods.attribution`) then checks, on the first step, that dpmem's rules split its gradients by sample."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

from torch import nn

from dpmem.config import ConfigError
from dpmem.sources import fetching, resolve_source, why_not_loaded
from dpmem.sources import offline as downloads_off

# the Auto class of each head (how each is trained: dpmem.data.text); image checkpoints classify
HEADS = {"classifier": "AutoModelForSequenceClassification", "causal": "AutoModelForCausalLM",
         "mlm": "AutoModelForMaskedLM"}
IMAGES = "AutoModelForImageClassification"


def _located(name: str, what: str):
    """(where to load `name` from, whether only local files may be read, why the hub is unreachable or None)."""
    offline = downloads_off()
    source = resolve_source(name, "model.pretrained")  # a local path that does not exist is said so here
    unreachable = None if offline or Path(source).exists() else fetching(what)
    return source, offline or unreachable is not None, unreachable


def _not_loaded(name: str, unreachable, e: Exception) -> ConfigError:
    hint = " (offline: only the local cache is searched)" if downloads_off() else ""
    why = why_not_loaded(unreachable, e) if isinstance(e, OSError) else str(e).splitlines()[0]
    return ConfigError("model.pretrained", f"cannot load {name!r}{hint}: {why}")


@functools.lru_cache(maxsize=16)
def _checkpoint_config(name: str):
    import transformers
    source, local, unreachable = _located(name, f"the model {name}")
    try:
        return transformers.AutoConfig.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError) as e:
        raise _not_loaded(name, unreachable, e) from None


def checkpoint_config(cfg):
    """The checkpoint's transformers config, `model.arch`'s fields set over it (a copy: the cached one stays)."""
    if not cfg.pretrained:
        raise ConfigError("model.pretrained", "model=auto builds a checkpoint's architecture: give its hub id or local "
                          "folder (model.pretrained=gpt2, or a folder with its config.json)")
    config = copy.deepcopy(_checkpoint_config(cfg.pretrained))
    for key, value in dict(cfg.arch or {}).items():
        setattr(config, key, value)
    return config


def is_image(config) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
    return config.model_type in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES


def model_type_of(name: str) -> str:
    return _checkpoint_config(name).model_type


def build_auto(cfg, data, weights: bool) -> nn.Module:
    """The checkpoint's model with the head `model.head` asks (image checkpoints: a classifier), its weights
    loaded unless `weights` is False (planning). Refused in one line: a head the checkpoint's type has no Auto
    class for, image data for a text model or the reverse, and weights that leave base-model parameters missing."""
    import transformers
    config = checkpoint_config(cfg)
    image = is_image(config)
    if image != (len(data.input_shape) == 3):
        raise ConfigError("data", f"{cfg.pretrained} is {'an image' if image else 'a text'} model "
                          f"({config.model_type}); this data set gives {'token ids' if image else 'images'}")
    if image and cfg.head != "classifier":
        raise ConfigError("model.head", f"an image checkpoint ({config.model_type}) trains as a classifier, not "
                          f"{cfg.head!r}")
    if cfg.head not in HEADS:
        raise ConfigError("model.head", f"{cfg.head!r}; allowed: {', '.join(HEADS)}")
    auto = getattr(transformers, IMAGES if image else HEADS[cfg.head])
    if cfg.head != "causal":
        config.num_labels = data.num_classes
    if cfg.head == "classifier" and not image and getattr(config, "pad_token_id", None) is None:
        # a decoder classifies on its last token, found by the padding id: the end-of-text id, as is usual
        config.pad_token_id = getattr(config, "eos_token_id", None)
    unreachable = None
    try:
        if not weights:
            return auto.from_config(config)
        source, local, unreachable = _located(cfg.pretrained, f"the model {cfg.pretrained}")
        model, info = auto.from_pretrained(source, config=config, local_files_only=local, output_loading_info=True,
                                           **({"ignore_mismatched_sizes": True} if image else {}))
    except ValueError as e:  # an Auto class without this model type ("Unrecognized configuration class ...")
        raise ConfigError("model.head", f"{config.model_type} has no {cfg.head} model in transformers "
                          f"({str(e).splitlines()[0][:120]})") from None
    except OSError as e:
        raise _not_loaded(cfg.pretrained, unreachable, e) from None
    if cfg.head == "mlm" and not hasattr(model, "lm_head"):
        raise ConfigError("model.head", f"{config.model_type}'s masked-LM head is not an `lm_head` (which the mlm "
                          "task reads); use head=classifier")
    _refuse_missing(cfg, model, info)
    return model


def _refuse_missing(cfg, model: nn.Module, info: dict) -> None:
    """Weights the checkpoint lacks for the base model (not the new head): a checkpoint of another architecture,
    or model.arch changing a shape, would train those parameters from random init behind transformers' warning."""
    prefix = getattr(model, "base_model_prefix", "")
    mismatched = [k if isinstance(k, str) else k[0] for k in info.get("mismatched_keys", [])]
    keys = [*info.get("missing_keys", []), *mismatched]
    # a head of another size (an image classifier fine-tuned on other classes) is new, as the classifier is
    missing = [k for k in keys if not prefix or k.startswith(f"{prefix}.")]
    if missing:
        raise ConfigError("model.pretrained", f"{cfg.pretrained!r} leaves {len(missing)} of the base model's "
                          f"parameters without weights (e.g. {missing[0]}): the checkpoint is not of this "
                          "architecture (or model.arch changed it); give a checkpoint of the architecture you train")


def lora_targets(model: nn.Module, excluded: list[str]) -> list[str]:
    """LoRA's target modules found by type: every Linear (and transformers' Conv1D) but the output head and the
    modules trained in full (`excluded`, name suffixes)."""
    from transformers.pytorch_utils import Conv1D
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = []
    for name, module in model.named_modules():
        inside = any(name == k or name.endswith(f".{k}") or f".{k}." in f".{name}." for k in excluded)
        if isinstance(module, (nn.Linear, Conv1D)) and module is not head and not inside:
            out.append(name)
    return out
