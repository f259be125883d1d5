"""torchvision data sets on tiny fixtures written in torchvision's own formats (MNIST's idx files, CIFAR's
pickles): shapes, normalisation, labels, class counts, the one-line errors (offline, failed download, files that
fail CIFAR's md5 check), per-batch resizing for a 224 model, and a private run."""

import os
import pickle
import socket
import struct
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from dpmem.composition import CONF_DIR
from dpmem.config import ConfigError
from dpmem.data import build_data, vision
from dpmem.data.images import at_model_size, per_sample_loss
from dpmem.engine.trainer import run_training


def config(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=["logging.progress=false", "logging.memory_steps=0", *overrides])


def idx(path, array: np.ndarray) -> None:
    """MNIST's idx format: magic (0, 0, 0x08 = ubyte, ndim), big-endian int32 sizes, then the bytes."""
    with open(path, "wb") as f:
        f.write(bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape))
        f.write(array.astype(np.uint8).tobytes())


def images(n, c, seed):
    x = np.random.default_rng(seed).integers(0, 256, (n, c, 32 if c == 3 else 28, 32 if c == 3 else 28))
    x[0, ..., 0, 0] = 255  # one known white and one black pixel
    x[0, ..., 0, 1] = 0
    return x.astype(np.uint8)


def write_fixtures(root) -> None:
    """Tiny MNIST, CIFAR-10 and CIFAR-100 in torchvision's on-disk formats under `root`."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, n in (("train", 12), ("t10k", 4)):
        idx(raw / f"{split}-images-idx3-ubyte", images(n, 1, n)[:, 0])
        idx(raw / f"{split}-labels-idx1-ubyte", np.arange(n) % 10)
    c10 = root / "cifar-10-batches-py"
    c10.mkdir()
    for i in range(1, 6):
        pickle.dump({"data": images(2, 3, i).reshape(2, -1), "labels": [i, i + 1]}, open(c10 / f"data_batch_{i}", "wb"))
    pickle.dump({"data": images(3, 3, 9).reshape(3, -1), "labels": [0, 1, 2]}, open(c10 / "test_batch", "wb"))
    pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, open(c10 / "batches.meta", "wb"))
    c100 = root / "cifar-100-python"
    c100.mkdir()
    pickle.dump({"data": images(5, 3, 1).reshape(5, -1), "fine_labels": [0, 7, 42, 99, 3]}, open(c100 / "train", "wb"))
    pickle.dump({"data": images(2, 3, 2).reshape(2, -1), "fine_labels": [5, 6]}, open(c100 / "test", "wb"))
    pickle.dump({"fine_label_names": [f"c{i}" for i in range(100)]}, open(c100 / "meta", "wb"))


@pytest.fixture
def roots(tmp_path, monkeypatch):
    # CIFAR checks every file's md5 against the published archive's, which a fixture cannot match (MNIST checks
    # presence only): here torchvision's check is reduced to presence; the md5 refusal is tested on its own
    import torchvision.datasets.cifar as cifar
    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    write_fixtures(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name,shape,n_train,n_test,classes,first_labels", [
    ("mnist", (1, 28, 28), 12, 4, 10, [0, 1, 2]),
    ("cifar10", (3, 32, 32), 10, 3, 10, [1, 2, 2]),
    ("cifar100", (3, 32, 32), 5, 2, 100, [0, 7, 42]),
])
def test_torchvision_sets_load_in_their_own_splits(roots, name, shape, n_train, n_test, classes, first_labels):
    cfg = config("model=vit-tiny", f"data={name}", f"data.root={roots}")
    d = build_data(cfg.data, cfg.model)
    assert d.train["pixel_values"].shape == (n_train, *shape) and len(d.test["labels"]) == n_test
    assert d.num_classes == classes and d.train["labels"][:3].tolist() == first_labels
    assert d.train["pixel_values"][0, :, 0, 0].eq(1.0).all() and d.train["pixel_values"][0, :, 0, 1].eq(-1.0).all()
    # CIFAR's rows are (3, 32, 32) in channel-major order: pixel (0, 5, 7) of channel 2 is byte 2·1024 + 5·32 + 7
    if name == "cifar10":
        raw = images(2, 3, 1).reshape(2, -1)[0, 2 * 1024 + 5 * 32 + 7]
        assert d.train["pixel_values"][0, 2, 5, 7].item() == pytest.approx((raw / 255 - 0.5) / 0.5)


def test_the_search_split_holds_out_part_of_the_training_set(roots):
    """data.eval_split=dev (the papers' C x lr search on an 80/20 split of the training set): the evaluated images
    are training images, disjoint from those trained on; the real test set is not touched."""
    full = build_data(*(lambda c: (c.data, c.model))(config("model=vit-tiny", "data=mnist", f"data.root={roots}")))
    cfg = config("model=vit-tiny", "data=mnist", f"data.root={roots}", "data.eval_split=dev", "data.test_fraction=0.25")
    d = build_data(cfg.data, cfg.model)
    assert len(d.train["labels"]) == 9 and len(d.test["labels"]) == 3
    rows = {tuple(x.flatten().tolist()) for x in full.train["pixel_values"]}
    held = [tuple(x.flatten().tolist()) for x in d.test["pixel_values"]]
    kept = [tuple(x.flatten().tolist()) for x in d.train["pixel_values"]]
    assert set(held) <= rows and set(kept) <= rows and not set(held) & set(kept)
    with pytest.raises(ConfigError, match="data.eval_split"):
        build_data(config("model=vit-tiny", "data=mnist", f"data.root={roots}", "data.eval_split=val").data,
                   cfg.model)


def test_absent_offline_is_one_line_within_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = config("model=vit-tiny", "data=cifar10", f"data.root={tmp_path}")
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        build_data(cfg.data, cfg.model)
    assert time.monotonic() - start < 5 and e.value.key == "data.root"
    message = str(e.value)
    assert "\n" not in message and str(tmp_path / "cifar-10-batches-py") in message
    assert "data_batch_5" in message and "batches.meta" in message and "network" in message


def test_a_failed_download_is_one_line_and_bounded_by_a_socket_timeout(tmp_path, monkeypatch):
    """Online, torchvision downloads; without network that must fail in seconds (the socket timeout) and leave
    the process's default timeout as it was."""
    from urllib.error import URLError
    from torchvision.datasets import MNIST
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "DPMEM_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    timeouts, before = [], socket.getdefaulttimeout()

    def no_network(self):
        timeouts.append(socket.getdefaulttimeout())
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried mirror, got:\n"
                           + str(URLError("Name or service not known")))

    monkeypatch.setattr(MNIST, "download", no_network)
    cfg = config("model=vit-tiny", "data=mnist", f"data.path={tmp_path}")
    with pytest.raises(ConfigError) as e:
        build_data(cfg.data, cfg.model)
    assert timeouts == [vision.DOWNLOAD_TIMEOUT_S] and socket.getdefaulttimeout() == before
    assert e.value.key == "data.path" and "\n" not in str(e.value) and "Name or service not known" in str(e.value)
    assert str(tmp_path / "MNIST" / "raw") in str(e.value) and "t10k-labels-idx1-ubyte" in str(e.value)


def test_cifar_files_that_are_not_the_published_ones_are_refused(tmp_path, monkeypatch):
    """torchvision reads CIFAR only when each file's md5 matches the published archive's: present but different
    files (here the fixtures, unpatched) are named as such, not taken for absent ones."""
    monkeypatch.setenv("DPMEM_OFFLINE", "1")
    write_fixtures(tmp_path)
    cfg = config("model=vit-tiny", "data=cifar100", f"data.root={tmp_path}")
    with pytest.raises(ConfigError, match="md5") as e:
        build_data(cfg.data, cfg.model)
    assert "\n" not in str(e.value) and str(tmp_path / "cifar-100-python") in str(e.value)


def test_batches_are_resized_to_the_model_and_the_loss_matches_prior_resizing():
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=8,
                                                num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                                                num_labels=3)).eval()
    small, labels = torch.randn(2, 3, 4, 4), torch.tensor([0, 2])
    by_hand = F.interpolate(small, size=(8, 8), mode="bilinear", align_corners=False)
    assert torch.equal(at_model_size(model, small), by_hand)
    torch.testing.assert_close(per_sample_loss(model, {"pixel_values": small, "labels": labels}),
                               per_sample_loss(model, {"pixel_values": by_hand, "labels": labels}))


def test_a_private_run_on_cifar10(roots, tmp_path):
    cfg = config("model=vit-tiny", "data=cifar10", f"data.root={roots}", "method=dp-adam", "train.steps=2",
                 "train.batch_size=4")
    summary = run_training(cfg, tmp_path / "run")
    assert summary["status"] == "ok" and summary["n_train"] == 10 and summary["metric_final"] is not None


@pytest.mark.parametrize("shape", [(12, 3, 8, 8), (12, 1, 8, 8), (12, 8, 8)])
def test_npz_images_read_the_same_channels_first_channels_last_or_grey(tmp_path, shape):
    """numpy and PIL keep images as (N, H, W, C): that layout reads as its transpose to torch's (N, C, H, W)."""
    x = np.random.default_rng(0).integers(0, 256, shape).astype(np.uint8)
    y = np.arange(12) % 2
    last = x.transpose(0, 2, 3, 1) if x.ndim == 4 else x
    bundles = {}
    for name, arrays in (("first", x), ("last", last)):
        np.savez(tmp_path / f"{name}.npz", x=arrays, y=y, x_test=arrays[:4], y_test=y[:4])
        bundles[name] = build_data(config("data=npz", f"data.path={tmp_path / name}.npz").data, None)
    expected = torch.as_tensor(x if x.ndim == 4 else x[:, None], dtype=torch.float32) / 127.5 - 1
    for b in bundles.values():
        torch.testing.assert_close(b.train["pixel_values"], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(b.test["pixel_values"], expected[:4], rtol=0, atol=1e-6)
        assert b.input_shape == tuple(expected.shape[1:])
