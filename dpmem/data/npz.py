"""Local image arrays: a .npz file with `x` (N, H, W), (N, C, H, W) or channels-last (N, H, W, C) in 0..255 (or floats
in 0..1) and integer labels `y`, optionally `x_test`/`y_test` (otherwise a stratified split of `x` is held out)."""

import sys
from pathlib import Path

import numpy as np

from dpmem.config import ConfigError
from dpmem.data.bundle import check_class_numbers, check_classes
from dpmem.data.images import image_bundle, value_scale


def load(cfg):
    if not cfg.path:
        raise ConfigError("data.path", "data=npz needs data.path=FILE.npz")
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise ConfigError("data.path", f"{cfg.path!r} does not exist; give a .npz file with arrays x and y")
    try:
        with np.load(path) as archive:  # no pickles: object arrays are refused as what they are
            arrays = {name: archive[name] for name in archive.files}
    except Exception as e:  # noqa: BLE001  (not a zip, truncated, pickled objects: each its own error)
        raise ConfigError("data.path", f"{cfg.path!r} is not a readable .npz archive ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else 'empty'}); write one with "
                          "numpy.savez(FILE, x=images, y=labels)") from None
    missing = {"x", "y"} - set(arrays)
    if missing:
        raise ConfigError("data.path", f"{cfg.path!r} lacks arrays {sorted(missing)}; it has {sorted(arrays)}")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise ConfigError("data.path", f"{cfg.path!r} has {'x_test' if 'x_test' in arrays else 'y_test'} without "
                          f"{'y_test' if 'x_test' in arrays else 'x_test'}: give both, or neither (a split of x is "
                          "then held out)")
    pairs = [("x", "y")] + ([("x_test", "y_test")] if "x_test" in arrays else [])
    for xs, ys in pairs:
        arrays[ys] = _checked(cfg.path, xs, arrays[xs], ys, arrays[ys])
    check_class_numbers(repr(cfg.path), np.concatenate([arrays[ys] for _, ys in pairs]))
    scales = {xs: value_scale(f"{cfg.path!r} {xs}", arrays[xs]) for xs, _ in pairs}
    if len({scale for scale, _ in scales.values()}) > 1:
        raise ConfigError("data.path", f"{cfg.path!r}: x and x_test are in different ranges ("
                          f"{'; '.join(note.split(': ', 1)[1] for _, note in scales.values())}); give both in 0..255 "
                          "or both in 0..1")
    scale, note = scales["x"]
    test = (arrays["x_test"], arrays["y_test"]) if "x_test" in arrays else (None, None)
    bundle = image_bundle(arrays["x"], arrays["y"], *test, test_fraction=cfg.test_fraction,
                          split_seed=cfg.split_seed, scale=scale)
    check_classes(bundle, "data.path", repr(cfg.path))
    if arrays["x"].dtype != np.uint8:  # uint8 is 0..255; other types' range is read off their values: said
        print(f"dpmem: data.path {note.replace(' x: ', ': ', 1)}", file=sys.stderr)
    return bundle


def _checked(path, xs: str, x: np.ndarray, ys: str, y: np.ndarray) -> np.ndarray:
    """The labels `y` as integers, once `x` and `y` are known to be images (N, H, W), (N, C, H, W) or (N, H, W, C)
    of finite numbers and one integer label per image (check_class_numbers checks they are classes)."""
    def bad(what: str) -> ConfigError:
        return ConfigError("data.path", f"{path!r}: {what}")
    if not np.issubdtype(x.dtype, np.number) or x.ndim not in (3, 4):
        raise bad(f"{xs} must be numeric images (N, H, W), (N, C, H, W) or (N, H, W, C), not {x.dtype} "
                  f"of shape {x.shape}")
    if len(x) == 0:
        raise bad(f"{xs} holds no images")
    if not np.isfinite(x).all():
        raise bad(f"{xs} holds {int((~np.isfinite(x)).sum())} NaN or infinite values")
    if y.ndim != 1 or len(y) != len(x):
        raise bad(f"{ys} has shape {y.shape}: one label per image of {xs} ({len(x)}) is needed")
    if not np.issubdtype(y.dtype, np.number) or not np.isfinite(y).all() or (y != np.round(y)).any():
        raise bad(f"{ys} must hold integer class numbers, not {y.dtype}" + (
            " values such as " + str(y[:3].tolist()) if len(y) else ""))
    return y.astype(np.int64)
