"""Inputs a new user tries (issue 44): each is one clear line (exit 2) or a sensible default said in one line, never
a traceback, a silent guess, or an empty run folder. Bad files are made on the fly; nothing here relies on timing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dpmem.composition import compose_points
from dpmem.data import build_data

TINY = ["train.steps=2", "train.batch_size=32", "logging.progress=false", "train.device=cpu",
        "train.eval_batch_size=512", "logging.memory_steps=0"]


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def one_error(r, key: str, *words: str) -> str:
    """The run was refused in one line that names `key` and says each of `words`."""
    lines = lines_of(r.stderr)
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"dpmem: error: {key}: ") and all(w in lines[0] for w in words), lines[0]
    return lines[0]


# -- train.lr=0 with a private method: said once, the run goes on ------------------------------------------------
def test_a_learning_rate_of_0_with_a_private_method_is_a_one_line_warning(cli, tmp_path):
    r = cli("train", "train.lr=0", *TINY, "hydra.run.dir=run")
    assert r.returncode == 0, r.stderr
    warnings = [line for line in lines_of(r.stderr) if line.startswith("dpmem: warning: train.lr")]
    assert len(warnings) == 1 and "spends privacy.epsilon=8" in warnings[0] and "changes nothing" in warnings[0]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "ok"
    for i, quiet in enumerate((["privacy=none"], ["train.lr=0.01"])):  # nothing spent; something learnt
        r = cli("train", *TINY, "train.lr=0", *quiet, "train.steps=1", f"hydra.run.dir=run{i}")
        assert r.returncode == 0 and "train.lr" not in r.stderr, r.stderr


# -- image value ranges of an .npz ---------------------------------------------------------------------------------
def npz(path: Path, x, y=None, **more) -> Path:
    y = np.arange(len(x)) % 4 if y is None else y
    np.savez(path, x=x, y=y, **more)
    return path


def images(n=40):
    return np.random.default_rng(0).integers(0, 256, (n, 8, 8)).astype(np.uint8)


def data_of(path: Path, *overrides):
    (cfg,) = compose_points([["data=npz", f"data.path={path}", *overrides]])
    return build_data(cfg.data, cfg.model)


def test_npz_images_in_0_to_1_are_read_as_such_and_said_in_one_line(tmp_path, capsys):
    x = images()
    as_bytes = data_of(npz(tmp_path / "bytes.npz", x))
    assert capsys.readouterr().err == ""  # uint8 is 0..255: nothing assumed, nothing said
    as_floats = data_of(npz(tmp_path / "floats.npz", (x / 255).astype(np.float32)))
    (line,) = lines_of(capsys.readouterr().err)
    assert "floats.npz" in line and "0..1" in line, line
    torch.testing.assert_close(as_floats.train["pixel_values"], as_bytes.train["pixel_values"], rtol=0, atol=1e-6)
    as_wide = data_of(npz(tmp_path / "wide.npz", x.astype(np.float64)))  # floats beyond 1: 0..255
    (line,) = lines_of(capsys.readouterr().err)
    assert "0..255" in line, line
    torch.testing.assert_close(as_wide.train["pixel_values"], as_bytes.train["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("case,words", [
    ("negative", ["from -10 to 245", "allowed: 0..255", "0..1"]),
    ("above-255", ["from 0 to 510", "allowed: 0..255"]),
    ("mixed", ["x and x_test are in different ranges"]),
])
def test_npz_images_outside_both_ranges_are_one_line(cli, tmp_path, case, words):
    x = images()
    if case == "negative":
        npz(tmp_path / "bad.npz", x.astype(np.float32) - 10)
    elif case == "above-255":
        npz(tmp_path / "bad.npz", x.astype(np.int32) * 2)
    else:
        npz(tmp_path / "bad.npz", (x / 255).astype(np.float32), x_test=x[:8], y_test=np.arange(8) % 4)
    r = cli("train", "data=npz", f"data.path={tmp_path / 'bad.npz'}", *TINY, "hydra.run.dir=run")
    one_error(r, "data.path", "bad.npz", *words)
    assert not (tmp_path / "run").exists()


# -- classes -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,key,words", [
    ("one-class", "data.path", ["every training label is 0", "at least 2 classes"]),
    ("one-class-with-test", "data.path", ["every training label is 0"]),
    ("class-of-one", "data.path", ["class 4 has 1 example", "stratified", "x_test and y_test"]),
    ("split-too-small", "data.test_fraction", ["4 classes", "stratified"]),
])
def test_one_class_or_a_class_too_small_to_split_is_one_line_and_leaves_no_folder(cli, tmp_path, case, key, words):
    x, y, extra, over = images(), np.arange(40) % 4, {}, []
    if case.startswith("one-class"):
        y = np.zeros(40, dtype=np.int64)
        if case == "one-class-with-test":
            extra = {"x_test": x[:8], "y_test": np.arange(8) % 2}
    elif case == "class-of-one":
        y = y.copy()
        y[0] = 4
    else:
        over = ["data.test_fraction=0.05"]  # 2 test examples for 4 classes
    npz(tmp_path / "d.npz", x, y, **extra)
    r = cli("train", "data=npz", f"data.path={tmp_path / 'd.npz'}", *over, *TINY, "hydra.run.dir=run")
    one_error(r, key, *words)
    assert not (tmp_path / "run").exists()


# -- dp-sgd-rc's probes --------------------------------------------------------------------------------------------
def test_more_probes_than_any_estimated_layer_is_wide_are_refused(cli, tmp_path):
    # vit-tiny on digits: the widest estimated matrix is the MLP's 64 x 128
    r = cli("train", "method=dp-sgd-rc", "method.k=100000", "privacy=none", *TINY, "hydra.run.dir=run")
    one_error(r, "method.k", "100000 probes exceed the larger side of every estimated layer", "allowed: 1..128")
    assert not (tmp_path / "run").exists()
    # the default k on a model narrower than it: said, and the run goes on
    narrow = ["model.arch.hidden_size=8", "model.arch.intermediate_size=16", "model.arch.num_attention_heads=2",
              "model.arch.patch_size=4", "model.arch.num_hidden_layers=1"]
    r = cli("train", "method=dp-sgd-rc", "privacy=none", *narrow, *TINY, "train.steps=1", "hydra.run.dir=narrow")
    assert r.returncode == 0, r.stderr
    (line,) = [line for line in lines_of(r.stderr) if "method.k" in line]
    assert line.startswith("dpmem: warning: method.k: 32 probes exceed") and "at most 16" in line, line


# -- train.device ----------------------------------------------------------------------------------------------------
def test_meta_is_not_offered_as_a_training_device(cli):
    for device in ("meta", "gpu"):
        line = one_error(cli("train", *TINY, f"train.device={device}"), "train.device", "auto, cpu, cuda")
        assert "meta]" not in line and "meta," not in line, line


# -- a sweeper's search space ----------------------------------------------------------------------------------------
SEARCH = ["-m", "hydra/sweeper=search", "hydra.sweeper.n_trials=1", "hydra.sweep.dir=search"]


@pytest.mark.parametrize("space,key,words", [
    ("train.lr=tag(log, interval(0, 1e-2))", "train.lr", ["log-scale interval needs a lower bound > 0"]),
    ("train.lrr=tag(log, interval(1e-3, 1e-2))", "train.lrr", ["not a key of the config", "allowed in train:",
                                                               "lr,"]),
    ("trian.lr=interval(1e-3, 1e-2)", "trian.lr", ["allowed: audit, data"]),
    ("method.rnk=int(interval(1, 4))", "method.rnk", ["grape has no option 'rnk'", "rank"]),
    ("train.lr=interval(1e-2, 1e-3)", "train.lr", ["lower bound is above its upper bound"]),
    ("train.steps=interval(1, 3)", "train.steps", ["int(interval(1, 3))"]),
    # the same, as the sweeper's own params (an experiment's hydra.sweeper.params, here given on the command line)
    ('hydra.sweeper.params={train.lr:"tag(log, interval(0, 0.01))"}', "train.lr", ["lower bound > 0"]),
    ('hydra.sweeper.params={train.lrr:"interval(0.001, 0.01)"}', "train.lrr", ["not a key of the config"]),
])
def test_a_bad_search_space_is_one_line_naming_the_key_before_the_search(cli, tmp_path, space, key, words):
    r = cli("train", *SEARCH, space, *TINY)
    one_error(r, key, *words)
    assert not (tmp_path / "search").exists()


# -- dpmem report ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [[], ["--published"], ["--out", "somewhere"]])
def test_report_without_a_folder_is_an_error(cli, args):
    r = cli("report", *args)
    lines = lines_of(r.stderr)
    assert r.returncode == 2 and len(lines) == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert lines[0].startswith("dpmem: error: ") and ("PATH" in lines[0] or "--out" in lines[0]), lines[0]


# -- local paths that do not exist -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,key", [
    (["model.pretrained=/nonexistent/path"], "model.pretrained"),
    (["model.pretrained=./no-such-model"], "model.pretrained"),
    (["model=roberta-tiny", "model.tokenizer=/nonexistent/tokenizer", "data=csv"], "model.tokenizer"),
])
def test_a_local_path_that_does_not_exist_says_so(cli, tmp_path, overrides, key):
    if "data=csv" in overrides:  # the data read, the tokenizer is what is missing
        (tmp_path / "t.csv").write_text("text,label\n" + "".join(f"film {i},{i % 2}\n" for i in range(20)))
        overrides = [*overrides, f"data.path={tmp_path / 't.csv'}"]
    r = cli("train", *overrides, *TINY, "hydra.run.dir=run")
    line = one_error(r, key, "the path does not exist")
    assert "repo" not in line.lower(), line
    assert not (tmp_path / "run").exists()


# -- the hub, unreachable: what is fetched is said at once, and the wait is one bounded request ---------------------
def unreachable_hub(tmp_path) -> dict:
    """An environment whose hub endpoint is a closed port on this machine (loopback only, nothing leaves it), with
    downloads on and an empty cache."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "DPMEM_OFFLINE")}
    return {**env, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "WANDB_MODE": "disabled"}


@pytest.mark.long
def test_a_hub_data_set_without_network_is_said_at_once_and_ends_in_one_line(tmp_path):
    from text_fixtures import make_tokenizer
    tok = make_tokenizer(tmp_path / "tok", "roberta")
    r = subprocess.run([sys.executable, "-m", "dpmem.cli", "train", "model=roberta-tiny", "data=sst2", "data.k=2",
                        f"model.tokenizer={tok}", *TINY, "hydra.run.dir=run"], cwd=tmp_path,
                       env=unreachable_hub(tmp_path), capture_output=True, text=True, timeout=300)
    lines = lines_of(r.stderr)
    assert r.returncode == 2 and len(lines) == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("dpmem: fetching the data set nyu-mll/glue/sst2") and "127.0.0.1:9" in lines[0]
    assert lines[1].startswith("dpmem: error: data.path: cannot load nyu-mll/glue/sst2") and \
        "did not answer" in lines[1] and "data.path" in lines[1], lines[1]
    assert not (tmp_path / "run").exists()


HUB_SCRIPT = """
import json, sys
from dpmem.config import ConfigError
from dpmem.data.prompting import load_tokenizer
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = type(load_tokenizer(type("M", (), {"tokenizer": name, "pretrained": None, "name": "m"}))).__name__
    except ConfigError as e:
        out[name] = {"key": e.key, "error": str(e)}
print(json.dumps(out))
"""


def test_a_hub_tokenizer_without_network_comes_from_the_cache_or_is_one_line(tmp_path):
    """The hub does not answer: a tokenizer in the local cache is used (as the hub's libraries would after their
    retries), one that is not there is one line at once."""
    from text_fixtures import make_tokenizer
    snapshot = tmp_path / "hf" / "hub" / "models--dpmem-test--tok" / "snapshots" / ("0" * 40)
    make_tokenizer(snapshot, "roberta")
    (snapshot / "config.json").write_text('{"model_type": "roberta"}')  # cached with a hub tokenizer's first load
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    r = subprocess.run([sys.executable, "-c", HUB_SCRIPT, "dpmem-test/tok", "FacebookAI/roberta-base"], cwd=tmp_path,
                       env=unreachable_hub(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert isinstance(out["dpmem-test/tok"], str), out  # the tokenizer's class: it loaded
    missing = out["FacebookAI/roberta-base"]
    assert missing["key"] == "model.tokenizer" and "did not answer" in missing["error"] and "\n" not in missing["error"]
    said = [line for line in lines_of(r.stderr) if line.startswith("dpmem: fetching")]
    assert [line.split(" from the hub")[0] for line in said] == [
        "dpmem: fetching the tokenizer dpmem-test/tok", "dpmem: fetching the tokenizer FacebookAI/roberta-base"]
