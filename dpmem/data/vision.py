"""torchvision's image data sets (DP-GRAPE §5.1 / App. C.1): MNIST, CIFAR-10 and CIFAR-100 with their fixed test splits.
Files are read from `data.root` (or `data.path`) in torchvision's layout and downloaded there when absent and
online; otherwise an absent data set is one line saying which files are missing where and how to provide them."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np

from dpmem.config import ConfigError
from dpmem.data.images import image_bundle
from dpmem.sources import offline as downloads_off

# data name -> (torchvision class name, number of classes: the data set's, not the largest label present)
DATASETS = {"mnist": ("MNIST", 10), "cifar10": ("CIFAR10", 10), "cifar100": ("CIFAR100", 100)}
DOWNLOAD_TIMEOUT_S = 10  # per socket operation: no network fails in seconds, not minutes


def load(cfg):
    import torchvision.datasets as tvd
    cls_name, classes = DATASETS[cfg.name]
    cls = getattr(tvd, cls_name)
    root = Path(cfg.path or cfg.root).expanduser()
    key = "data.path" if cfg.path else "data.root"
    try:
        splits = [cls(root, train=train) for train in (True, False)]
    except RuntimeError:  # torchvision: "Dataset not found or corrupted"
        splits = _download(cls, root, key)
    x_train, x_test = (np.asarray(s.data) for s in splits)  # MNIST's (N, 28, 28), CIFAR's (N, 32, 32, 3)
    y_train, y_test = (np.asarray(s.targets) for s in splits)
    if cfg.eval_split == "dev":  # the papers' hyperparameter search: test_fraction of the training set held out
        order = np.random.default_rng(cfg.split_seed).permutation(len(y_train))
        cut = round(len(order) * cfg.test_fraction)
        x_test, y_test, x_train, y_train = (x_train[order[:cut]], y_train[order[:cut]], x_train[order[cut:]],
                                            y_train[order[cut:]])
    elif cfg.eval_split != "test":
        raise ConfigError("data.eval_split", f"{cfg.eval_split!r}: allowed test (the data set's own), dev")
    # otherwise the data set's own split: data.test_fraction and data.split_seed do not apply
    return image_bundle(x_train, y_train, x_test, y_test, test_fraction=0.0, split_seed=0, scale=255.0,
                        num_classes=classes)


def files(cls) -> list[str]:
    """The files torchvision reads, relative to the root, from its own lists (so they follow its version). MNIST
    checks that its raw idx files exist; CIFAR checks each file's md5 against the published archive."""
    if hasattr(cls, "resources"):  # MNIST: the .gz downloads, read uncompressed from MNIST/raw
        return [f"{cls.__name__}/raw/{os.path.splitext(name)[0]}" for name, _ in cls.resources]
    names = [name for name, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    return [f"{cls.base_folder}/{name}" for name in names]


def _download(cls, root: Path, key: str):
    expected = files(cls)
    folder = root / os.path.dirname(expected[0])
    missing = [os.path.basename(f) for f in expected if not (root / f).is_file()]
    copy = f"copy a torchvision download's files there, or point {key} at its root"
    if not missing:
        raise ConfigError(key, f"{cls.__name__}'s files in {folder} fail torchvision's md5 check (not the published "
                          f"ones); delete them to download again, or {copy}")
    absent = f"{cls.__name__} files missing in {folder}: {', '.join(missing)}"
    if downloads_off():
        raise ConfigError(key, f"{absent}; downloads are off (an offline variable, e.g. HF_HUB_OFFLINE, is set): "
                          f"run once with network access, or {copy}")
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        return [cls(root, train=train, download=True) for train in (True, False)]
    except Exception as e:  # URLError, timeouts, a bad checksum: all mean the same to the user
        reason = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
        raise ConfigError(key, f"{absent}; the download failed ({type(e).__name__}: {reason[-1][:160]}): run "
                          f"again with network access, or {copy}") from None
    finally:
        socket.setdefaulttimeout(previous)
