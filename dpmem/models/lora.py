"""LoRA adapters through peft: with `model.lora.r` set, every target layer gets a trainable low-rank update
B·A·(alpha/r) beside its frozen weight, and only the adapters and the modules to save are trained (DP-LoRA when
the method is private: per-sample gradients, clipping and noise cover exactly those parameters).

The adapters are injected in place (peft.inject_adapter_in_model, the same layers get_peft_model injects), so the
result is still the transformers model: `base_model`, `lm_head` and the module names the methods match keep their
meaning. Modules to save are unfrozen in place rather than copied as peft's modules_to_save does: no frozen
duplicate of the head, and a head tied to the embeddings stays tied."""

from __future__ import annotations

import re

from torch import nn

from dpmem.config import ConfigError


def apply_lora(cfg, model: nn.Module) -> nn.Module:
    lora = cfg.lora
    if lora.r is None:
        return model
    if lora.r <= 0:
        raise ConfigError("model.lora.r", f"{lora.r} must be a positive integer (or null for no LoRA)")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError("model.lora.dropout", f"{lora.dropout}: allowed [0, 1)")
    import peft
    saved = list(lora.modules_to_save) if lora.modules_to_save is not None else (
        _head_modules(cfg, model) if cfg.head == "classifier" else [])
    to_save = []
    for key in saved:
        found = [m for name, m in model.named_modules() if name == key or name.endswith("." + key)]
        if not found:
            raise ConfigError("model.lora.modules_to_save", f"{key!r} names no module of {cfg.name} "
                              "(a module-name suffix, e.g. classifier)")
        to_save += found
    targets = list(lora.target_modules) if lora.target_modules is not None else None
    if targets is None and cfg.family == "auto":  # any architecture: its Linear layers, found by type
        from dpmem.models.hub import lora_targets
        targets = lora_targets(model, saved)
    config = peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
        # as peft does for its modules_to_save: no adapter inside a module that is trained in full
        exclude_modules=f"(.*\\.)?({'|'.join(map(re.escape, saved))})(\\..*)?" if saved else None)
    try:  # freezes everything but the adapters
        peft.inject_adapter_in_model(config, model)
    except ValueError as e:  # no target found, or no default targets for this architecture
        hint = "" if lora.target_modules is not None else f"; peft has no default for {cfg.family}: name them"
        raise ConfigError("model.lora.target_modules", str(e).splitlines()[0] + hint) from None
    for module in to_save:  # excluded from the targets above, so still in the model as they were
        module.requires_grad_(True)
    return model


def _head_modules(cfg, model: nn.Module) -> list[str]:
    """The classifier head, trained in full: `classifier` in dpmem's families; for model=auto, whatever beside the
    base model holds parameters (GPT-2's `score`, BERT's `classifier`)."""
    if cfg.family != "auto":
        return ["classifier"]
    base = getattr(model, "base_model_prefix", "")
    return [name for name, child in model.named_children() if name != base and any(True for _ in child.parameters())]
