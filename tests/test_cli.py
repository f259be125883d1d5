"""The command line as a user meets it: bad input gives one clear line, a run writes a complete summary.

Most tests call dpmem.cli.main in this process (the `cli` fixture of conftest.py: exit code, stdout, stderr);
the console entry point itself runs as a real subprocess where a process is what is tested: its exit status
and stderr for bad input, and Ctrl-C."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["train.steps=3", "train.batch_size=32", "logging.progress=false", "train.eval_batch_size=512"]


def dpmem(*args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "dpmem.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("override,key,allowed", [
    ("method=nope", "method", "adam, dp-adam, dp-adam-materialize, dp-sgd"),
    ("privacy=eps3", "privacy", "eps1, eps2"),
    ("privacy.epsilon=0", "privacy.epsilon", "> 0"),
    ("privacy.epsilon=-1", "privacy.epsilon", "> 0"),
    ("privacy.epsilon=inf", "privacy.epsilon", "finite"),
    ("privacy.epsilon=1e9", "privacy.epsilon", "protects nothing"),  # looser than the least noise gives
    ("logging.every=0", "logging.every", "positive"),  # a ZeroDivisionError after one step
    ("data.test_fraction=1.5", "data.test_fraction", "0 < x < 1"),
    ("data.test_fraction=0", "data.test_fraction", "0 < x < 1"),
    ("privacy.delta=1.5", "privacy.delta", "(0, 1)"),
    ("privacy.delta=0", "privacy.delta", "(0, 1)"),
    ("train.physical_batch_size=256", "train.physical_batch_size", "1..train.batch_size"),
    ("train.eval_batch_size=0", "train.eval_batch_size", "positive"),  # else the run fails at its last step
    ("privacy.accountant=moments", "privacy.accountant", "pld"),
    ("train.no_such_key=1", "train.no_such_key", ""),
    ("data=npz", "data.path", "data.path=FILE.npz"),
    ("model=roberta-tiny", "model", "model=vit-tiny"),
    ("method=dp-adam method.clipping=sometimes", "method.clipping", "materialize"),
    ("method=dp-sgd-rc method.k=0", "method.k", "positive"),
    # an option of another method is refused, naming the method's own
    ("method=dp-adam method.rank=8", "method.rank", "dp-adam has no option 'rank'; allowed: betas, check_coverage"),
    ("method=dp-adam method.estimator=hutchpp", "method.estimator", "dp-adam has no option"),
    ("method=dp-sgd-rc method.clipping=ghost", "method.clipping", "estimator, k"),
    # a rank no layer exceeds would run grape as dp-adam; a head count that does not divide the width
    ("method=grape method.rank=1000", "method.rank", "nothing would be projected; allowed: 1..63"),
    ("model=llama-tiny data=synthetic model.arch.hidden_size=30", "model.arch.num_attention_heads", "divisor of 30"),
])
def test_bad_input_is_one_clear_line(cli, override, key, allowed):
    r = cli("train", *TINY, *override.split())  # the override last: it wins over TINY's
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert key in lines[0] and allowed in lines[0], lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("overrides,key,allowed", [
    (["method=dp-sgd-rc", "privacy.accountant=pld"], "privacy.accountant", "rc, auto"),  # pld would understate ε
    (["method=dp-adam", "privacy.accountant=rc"], "privacy.accountant", "auto, pld, rdp"),
    (["method=grape", "method.clipping=ghost"], "method.clipping", "grape has no option 'clipping'"),
    (["method=dp-sgd-rc", "privacy.neighbouring=replace_one"], "privacy.neighbouring", "add_remove"),
    (["method=dp-sgd-rc", "privacy.rc_dimension=wide"], "privacy.rc_dimension", "model, max_layer"),
    (["method=dp-sgd-rc", "privacy.rc_dimension=0"], "privacy.rc_dimension", "positive integer"),
])
def test_inconsistent_clipping_and_accounting_are_refused(cli, overrides, key, allowed):
    r = cli("train", *overrides, *TINY)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert key in r.stderr and allowed in r.stderr, r.stderr


def test_the_console_entry_point_exits_2_with_one_line_for_bad_input(tmp_path):
    """A real process: the exit status and stderr a shell sees (the cases above run in this process)."""
    r = dpmem("train", "method=nope", *TINY, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "method" in lines[0] and "adam, dp-adam, dp-adam-materialize, dp-sgd" in lines[0], r.stderr


def test_missing_data_file_names_the_key(cli):
    r = cli("train", "data=npz", "data.path=/no/such/file.npz", *TINY)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "data.path" in r.stderr and "does not exist" in r.stderr


def test_unreachable_epsilon_is_refused_before_training(cli):
    r = cli("train", "privacy.epsilon=0.001", "train.batch_size=1437", "train.steps=10000",
            "logging.progress=false")
    assert r.returncode == 2 and "privacy.epsilon" in r.stderr and "unreachable" in r.stderr
    assert "Traceback" not in r.stderr


def test_debug_shows_the_traceback(cli):
    """debug=true lets the exception out (Python prints its traceback) instead of the one line and exit 2."""
    from dpmem.config import ConfigError
    with pytest.raises(ConfigError, match="privacy.epsilon"):
        cli("train", "privacy.epsilon=-1", "debug=true", *TINY)


REQUIRED = ["method", "model", "data", "seed", "status", "epsilon_target", "epsilon_spent", "delta", "sigma",
            "sample_rate", "steps", "batch_size", "metric_name", "metric_final", "metric_best",
            "peak_memory_bytes", "throughput_samples_per_s", "wall_time_s", "versions"]


def test_a_run_writes_a_complete_summary(cli, tmp_path):
    r = cli("train", *TINY, "hydra.run.dir=run", "train.physical_batch_size=8", "train.device=cpu")  # live tensors
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert not [k for k in REQUIRED if k not in summary]
    assert summary["status"] == "ok" and summary["steps_done"] == 3
    assert summary["method"] == "grape" and summary["epsilon_target"] == 8
    assert 0 < summary["epsilon_spent"] <= 8.0 and summary["sigma"] > 0
    # the default delta: min(1e-5, 1/n^1.1) with n = 1437, well below 1/n, and no warning about it
    assert summary["delta"] == pytest.approx(1e-5) and summary["delta_times_n"] == pytest.approx(1437e-5)
    assert "warning" not in r.stderr and summary["sample_rate"] == pytest.approx(32 / 1437)
    assert 0 <= summary["metric_final"] <= 1 and summary["peak_memory_bytes"] > 0
    assert summary["peak_memory_source"] == "live_tensors"
    assert {"torch", "transformers", "dpmem", "git"} <= set(summary["versions"])
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["step"] == 3 and {"loss", "lr", "epsilon", "samples_per_s", "memory_bytes"} <= set(metrics[0])
    assert (tmp_path / "run" / "config.yaml").exists()
    assert "epsilon spent / target" in r.stdout  # the closing table


@pytest.mark.parametrize("choice", ["model", "max_layer"])
def test_dp_sgd_rc_run_is_accounted_by_the_rc_accountant(cli, tmp_path, choice):
    """The summary says which accountant and envelope produced ε, and ε is that accountant's for the run's σ.
    vit-tiny's estimated matrices are its patch convolution (64 × 1·2·2), 64×64 attention, 64×128 / 128×64 MLP
    and 10×64 head: max-min 64. Its biases and LayerNorms are normed exactly, so the sound d is inf.
    ε = 1: the rc accountant calibrates in a few seconds there (at ε = 8, σ is small and it takes far longer)."""
    from dpmem.privacy import epsilon_spent
    r = cli("train", "method=dp-sgd-rc", "privacy=eps1", f"privacy.rc_dimension={choice}", *TINY,
            "logging.memory_steps=0", "hydra.run.dir=run")
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["status"] == "ok" and s["accountant"] == "rc" and s["clipping"] == "hutch"
    d = float("inf") if choice == "model" else 64
    assert s["rc_accountant"] == {"k": 32, "d": "inf" if choice == "model" else 64, "d_max_layer": 64,
                                  "estimator": "hutch"}
    want = epsilon_spent(s["sigma"], s["delta"], s["sample_rate"], 3, "rc", k=32, d=d,
                         loss_noise=s["loss_sigma"] / s["sigma"])  # each step's noised training loss too
    assert s["epsilon_spent"] == pytest.approx(want, rel=1e-9) and 0.99 * 1 < want <= 1


def test_multirun_makes_one_run_folder_per_point(cli, tmp_path):
    r = cli("train", "-m", "method=adam,dp-adam", "privacy=eps2,none", *TINY, "logging.memory_steps=0",
            "hydra.sweep.dir=sweep")
    assert r.returncode == 0, r.stderr
    summaries = [json.loads(p.read_text()) for p in sorted((tmp_path / "sweep").glob("*/summary.json"))]
    assert len(summaries) == 4 and all(s["status"] == "ok" for s in summaries)
    seen = {(s["method"], s["epsilon_target"]) for s in summaries}
    assert seen == {("adam", None), ("dp-adam", 2), ("dp-adam", None)}
    dp_none = [s for s in summaries if s["method"] == "dp-adam" and s["epsilon_target"] is None][0]
    assert dp_none["sigma"] == 0.0 and dp_none["epsilon_spent"] == "inf"  # clipping only: not private
    adam = [s for s in summaries if s["method"] == "adam"]
    assert [s["epsilon_spent"] for s in adam] == ["inf", "inf"]
    # a budget on a non-private method: said, recorded, and the two adam runs are one sample in the report
    assert [s["privacy_ignored"] for s in adam] == ["privacy.epsilon=2 has no effect: adam is not private", None]
    assert r.stderr.count("privacy.epsilon=2 has no effect") == 1
    assert adam[0]["metric_final"] == adam[1]["metric_final"]  # they trained the same thing
    r = cli("report", "sweep")
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "sweep" / "report" / "report.csv") as f:
        n = {(row["method"], row["epsilon"]): int(row["n"]) for row in csv.DictReader(f)}
    assert n == {("adam", "non-private"): 1, ("dp-adam", "2"): 1, ("dp-adam", "non-private"): 1}
    assert "counted once" in r.stdout


def test_train_help_lists_the_groups_a_user_picks_from_and_the_composed_config(cli, tmp_path):
    from dpmem.composition import CONF_DIR
    r = cli("train", "method=dp-adam", "--help")
    assert r.returncode == 0, r.stderr
    groups = dict(line.split(": ", 1) for line in r.stdout.split("== Config ==")[0].splitlines() if ": " in line)
    yamls = {p.relative_to(CONF_DIR).with_suffix("") for p in Path(CONF_DIR).rglob("*.yaml") if p.parent.name != "conf"
             and not p.relative_to(CONF_DIR).parts[0] == "hydra"}
    listed = {Path(group) / option for group, options in groups.items() for option in options.split(", ")}
    assert listed == yamls  # every option file, and nothing else (not the schemas registered for validation)
    assert "clipping: bk" in r.stdout.split("== Config ==")[1] and not list(tmp_path.iterdir())


def test_a_bad_point_in_a_sweep_is_caught_before_launch(cli, tmp_path):
    r = cli("train", "-m", "privacy.epsilon=2,-3", *TINY, "hydra.sweep.dir=sweep")
    assert r.returncode == 2 and "privacy.epsilon" in r.stderr
    assert not (tmp_path / "sweep").exists()


@pytest.mark.long
@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_leaves_a_readable_summary(tmp_path, sig, code):
    """Ctrl-C and SIGTERM (scancel, torchrun stopping the ranks) interrupt the run and stop a sweep."""
    import signal
    import time
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "dpmem.cli", "train", "-m", "train.steps=100000", "train.seed=0,1",
                             "logging.every=1", "logging.progress=false", "hydra.sweep.dir=sweep",
                             "hydra.sweep.subdir=${hydra.job.num}"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "sweep" / "0" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(getattr(signal, sig))
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # no orphan left training if the signal was lost
    assert proc.returncode == code, err
    summary = json.loads((metrics.parent / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps_done"] >= 2
    assert summary["error"] == (None if sig == "SIGINT" else "SIGTERM")
    assert 0 < summary["epsilon_spent"] < 8  # what the steps done actually spent
    assert "interrupted" in out
    assert not (tmp_path / "sweep" / "1").exists()  # the sweep stopped


def bad_npz(path, case):
    """One .npz (or not) that is wrong in one way, made on the fly."""
    import numpy as np
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (20, 8, 8)).astype(np.uint8), np.arange(20) % 4
    arrays = {"x": x, "y": y}
    if case == "not-a-zip":
        path.write_bytes(b"these are not arrays")
        return
    if case == "lengths":
        arrays["y"] = y[:15]
    elif case == "nan":
        arrays["x"] = x.astype(np.float32)
        arrays["x"][3, 2, 2] = np.nan
    elif case == "negative":
        arrays["y"] = y - 1
    elif case == "fractional":
        arrays["y"] = y + 0.5
    elif case == "strings":
        arrays["y"] = np.array(["cat", "dog"] * 10)
    elif case == "huge":
        arrays["y"] = y * 10**6
    elif case == "test-without-labels":
        arrays["x_test"] = x[:5]
    np.savez(path, **arrays)


NPZ_CASES = {"not-a-zip": "not a readable .npz", "lengths": "one label per image", "nan": "NaN or infinite",
             "negative": "negative labels", "fractional": "integer class numbers", "strings": "integer class numbers",
             "huge": "classes for 20 examples", "test-without-labels": "x_test without y_test"}


@pytest.mark.parametrize("case", NPZ_CASES)
def test_a_bad_npz_is_one_line_naming_the_file(cli, tmp_path, case):
    bad_npz(tmp_path / "bad.npz", case)
    r = cli("train", "data=npz", f"data.path={tmp_path / 'bad.npz'}", *TINY)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "data.path" in lines[0] and "bad.npz" in lines[0] and NPZ_CASES[case] in lines[0], lines[0]


@pytest.mark.parametrize("args,key", [
    (["train", "hydra.run.dir=afile/run"], "hydra.run.dir"),
    (["train", "-m", "train.seed=0,1", "hydra.sweep.dir=afile/sweep"], "hydra.sweep.dir"),
    (["memory", "hydra.run.dir=afile/plan"], "hydra.run.dir"),
    (["memory", "memory.dir=afile/plan"], "memory.dir"),
    (["audit", "hydra.run.dir=afile/audit"], "hydra.run.dir"),
    (["spectrum", "mode=layer", "spectrum.dir=afile/s"], "spectrum.dir"),
])
def test_an_output_folder_that_cannot_be_made_is_one_line_before_anything_runs(cli, tmp_path, args, key):
    (tmp_path / "afile").write_text("a file where a folder would go")  # root may write anywhere: a file cannot hold
    r = cli(*args, *TINY[:1])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"dpmem: error: {key}: afile/") and "is a file, not a folder" in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing made, nothing trained


TEXT_CASES = {"empty": (b"", "not a readable"), "header-only": (b"text,label\n", "has no rows"),
              "malformed": (b'text,label\n"an open quote,1\nb,0\n', "not a readable"),
              "latin-1": ("text,label\ncaf\u00e9,1\n".encode("latin-1"), "not a readable"),
              "blank-label": (b"text,label\ngood,1\nbad,\n", "empty cells"),
              "huge-label": (b"text,label\ngood,1000000\nbad,0\nfine,1\n", "run from 0 to 1000000"),
              "negative-label": (b"text,label\ngood,-1\nbad,0\nfine,1\n", "run from -1 to 1")}


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
@pytest.mark.parametrize("case", TEXT_CASES)
def test_a_bad_text_file_is_one_line_naming_the_file(cli, tmp_path, kind, case):
    content, words = TEXT_CASES[case]
    if kind == "jsonl" and case in ("empty", "header-only"):  # a jsonl file has no header: empty is no rows
        content, words = b"", "has no rows"
    if kind == "jsonl" and case == "blank-label":
        content = b'{"text": "good", "label": 1}\n{"text": "bad", "label": null}\n'
    if kind == "jsonl" and case == "malformed":
        content = b'{"text": "good", "label": 1}\n{"text": "bad", \n'
    if kind == "jsonl" and case.endswith("-label") and case != "blank-label":  # the same rows as JSON lines
        content = "".join(json.dumps({"text": t, "label": int(y)}) + "\n"
                          for t, y in (line.split(",") for line in content.decode().splitlines()[1:])).encode()
    if kind == "jsonl" and case == "latin-1":
        content = '{"text": "caf\u00e9", "label": 1}\n'.encode("latin-1")
    (tmp_path / f"bad.{kind}").write_bytes(content)
    r = cli("train", "model=roberta-tiny", f"data={kind}", f"data.path={tmp_path / f'bad.{kind}'}", *TINY)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "data.path" in lines[0] and f"bad.{kind}" in lines[0] and words in lines[0], lines[0]
