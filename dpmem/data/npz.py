"""Local image arrays: a .npz file with `x` (N, H, W) or (N, C, H, W) in 0..255 and integer labels `y`,
optionally `x_test`/`y_test` (otherwise a stratified split of `x` is held out)."""

from pathlib import Path

import numpy as np

from dpmem.config import ConfigError
from dpmem.data.images import image_bundle


def load(cfg):
    if not cfg.path:
        raise ConfigError("data.path", "data=npz needs data.path=FILE.npz")
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise ConfigError("data.path", f"{cfg.path!r} does not exist; give a .npz file with arrays x and y")
    arrays = np.load(path)
    missing = {"x", "y"} - set(arrays.files)
    if missing:
        raise ConfigError("data.path", f"{cfg.path!r} lacks arrays {sorted(missing)}; it has {arrays.files}")
    test = (arrays["x_test"], arrays["y_test"]) if "x_test" in arrays.files else (None, None)
    return image_bundle(arrays["x"], arrays["y"], *test, test_fraction=cfg.test_fraction,
                        split_seed=cfg.split_seed, scale=255.0)
