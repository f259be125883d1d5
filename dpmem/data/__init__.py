"""Data sets as in-memory column tensors, with the task that turns a batch into per-sample losses and the metric
that scores the model on the evaluation split."""

from __future__ import annotations

import hashlib

import torch

from dpmem.config import ConfigError
from dpmem.data.bundle import DataBundle, check_classes, is_loss  # noqa: F401  (the package's API)


def build_data(cfg, model_cfg) -> DataBundle:
    """The data set of `cfg`. Synthetic data takes its kind (images or token ids) from the model; text tasks take
    the model's tokenizer and head (which prompt, how a class is read off)."""
    from dpmem.data import digits, median, npz, synthetic, tasks, vision
    loaders = {"digits": digits.load, "npz": npz.load, "median": median.load,
               "synthetic": lambda c: synthetic.load(c, model_cfg),
               **{name: vision.load for name in vision.DATASETS},
               **{name: (lambda c: tasks.load(c, model_cfg)) for name in tasks.TASKS}}
    if cfg.name not in loaders:
        raise ConfigError("data.name", f"{cfg.name!r} is unknown; allowed: {', '.join(loaders)}")
    data = loaders[cfg.name](cfg)
    if cfg.get("users") is not None:
        if data.users is not None:
            raise ConfigError("data.users", f"data.columns.user={cfg.columns.user!r} names the data's own users; "
                              "made-up users (data.users) are for data without a user column")
        from dpmem.data.users import made_up
        data.users = made_up(data.n_train, cfg.users, cfg.split_seed)
    check_classes(data, "data.path" if cfg.path else "data.name", repr(cfg.path) if cfg.path else f"data={cfg.name}")
    return data


def fingerprint(data: DataBundle) -> str:
    """sha256 of the training split as loaded (each column's name, dtype, shape and bytes): what a checkpoint resumes
    on. Of the examples rather than the files: it covers every source (a file in any format, a hub cache, synthetic
    data) and exactly what the batches index, for one pass over tensors already in memory."""
    h = hashlib.sha256()
    columns = {**data.train, **({"users": data.users} if data.users is not None else {})}  # who wrote what, too
    for name, column in sorted(columns.items()):
        column = column.detach().cpu().contiguous()
        h.update(f"{name}:{column.dtype}:{tuple(column.shape)};".encode())
        h.update(column.view(-1).view(torch.uint8).numpy())  # every dtype's bytes (bfloat16 has no numpy type)
    return h.hexdigest()


def example_batch(data: DataBundle, size: int, device, columns: dict[str, torch.Tensor] | None = None
                  ) -> dict[str, torch.Tensor]:
    """A batch of `size` copies of the first example of `columns` (default: the training split) on `device` (meta:
    shapes only), for planning."""
    return {k: v[:1].expand(size, *v.shape[1:]).contiguous().to(device)
            for k, v in (data.train if columns is None else columns).items()}
