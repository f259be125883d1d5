"""Issue 44: a run folder survives a second run started in it, damaged records and a full disk. One writer per
folder (an OS lock that dies with its holder), privacy.jsonl read line by line (what cannot be read is skipped and
said, a missing ledger refuses the resume), metrics.jsonl and summary.json damage in one line, and a full disk ends
the run failed with the last good checkpoint and the ledger whole. Every damage is made on the fly; nothing waits
on a clock (a second process is sequenced through its pipes)."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from dpmem.composition import CONF_DIR
from dpmem.engine import checkpoint as checkpoint_module
from dpmem.engine import summary as summary_module
from dpmem.engine.folder import LOCK, MARK, FolderLock, FolderRefused, owner
from dpmem.engine.summary import DiskFull, append_privacy, read_ledger
from dpmem.engine.trainer import run_training
from dpmem.methods import METHODS
from helpers import dies_at

# a tiny private run (6 steps, a checkpoint every 2) whose seeds are fixed, so that a resumed run is the oracle's
OVERRIDES = ["method=dp-adam", "train.steps=6", "train.batch_size=32", "train.device=cpu", "logging.progress=false",
             "logging.every=1", "logging.memory_steps=0", "train.checkpoint_every=2", "privacy.epsilon=0.1",
             "privacy.noise_seed=3", "privacy.sampler_seed=3", "model.arch.hidden_size=16",
             "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2", "model.arch.intermediate_size=32",
             "model.arch.patch_size=4"]


def config(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=[*OVERRIDES, *overrides])


def ledger_lines(folder) -> list[bytes]:
    return (folder / "privacy.jsonl").read_bytes().split(b"\n")


def files(folder) -> dict:
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Made once, copied by each test: an uninterrupted run's summary (the oracle), and a folder whose run died in
    step 5 with its checkpoint of step 4 (privacy.jsonl: start, steps 1-4, end)."""
    base = tmp_path_factory.mktemp("made")
    oracle = run_training(config(), base / "oracle")
    with pytest.MonkeyPatch.context() as mp:
        dies_at(mp, METHODS["dp-adam"], 5)
        with pytest.raises(RuntimeError, match="went away"):
            run_training(config(), base / "dead")
    return oracle, base / "dead"


@pytest.fixture
def dead(made, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(made[1], folder)
    return folder


@pytest.fixture
def oracle(made):
    return made[0]


# -- one writer per run folder ----------------------------------------------------------------------------

HOLDER = """
import sys
from hydra import compose, initialize_config_dir
from dpmem.composition import CONF_DIR
from dpmem.engine.trainer import run_training
from dpmem.methods import METHODS

cls, calls = METHODS["dp-adam"], []
real = cls.step

def step(self, micro, loss_fn):  # in its third step (its checkpoint of step 2 written) it says so, and waits
    calls.append(1)
    if len(calls) == 3:
        print("holding", flush=True)
        sys.stdin.readline()
    return real(self, micro, loss_fn)

cls.step = step
with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
    cfg = compose("config", overrides=sys.argv[2:])
run_training(cfg, sys.argv[1])
"""


@pytest.mark.long
def test_a_second_run_in_a_busy_folder_is_refused_and_a_killed_holder_blocks_no_resume(tmp_path, cli):
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    with open(tmp_path / "holder.err", "w") as err:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), *OVERRIDES], cwd=tmp_path, env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = holder.stdout.readline()  # the holder is in its third step: it holds the folder
        assert line == "holding\n", (tmp_path / "holder.err").read_text()
        before = files(run)
        r = cli("train", *OVERRIDES, f"hydra.run.dir={run}")
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "being written by another dpmem run" in lines[0] and f"pid {holder.pid} on " in lines[0], lines[0]
        assert files(run) == before  # nothing written: no interleaved ledger or metrics lines
    finally:
        holder.kill()  # SIGKILL: the OS lets go of its lock; its .lock file stays behind
        holder.wait()
    assert holder.returncode == -signal.SIGKILL
    assert json.loads((run / LOCK).read_text())["pid"] == holder.pid
    resumed = run_training(config(), run)
    assert resumed["status"] == "ok" and resumed["resumed_from_step"] == 2 and resumed["steps_done"] == 6
    assert not (run / LOCK).exists()


def test_the_lock_is_held_while_a_run_writes_and_is_not_a_record(tmp_path, cli):
    run = tmp_path / "run"
    lock = FolderLock(run)  # another holder (flock conflicts between open files of one process too)
    lock.acquire()
    with pytest.raises(FolderRefused, match=f"being written by another dpmem run \\(pid {os.getpid()} on "):
        run_training(config("train.steps=2"), run)
    assert {f.name for f in run.iterdir()} == {LOCK}  # refused before anything was written
    lock.release()
    assert not run.exists()  # the lock made the folder, and nothing else was written into it
    # a stale .lock (what a killed run leaves) is no record: a new run starts, takes it over and removes it
    run.mkdir()
    (run / LOCK).write_text("garbage")
    s = run_training(config("train.steps=2", "train.checkpoint_every=0"), run)
    assert s["status"] == "ok" and LOCK not in {f.name for f in run.iterdir()}
    (run / LOCK).write_text('{"pid": 1, "host": "elsewhere", "since": "then"}')
    with pytest.raises(FolderRefused, match="train.overwrite=true replaces it"):  # the summary refuses, not the lock
        run_training(config("train.steps=2", "train.checkpoint_every=0"), run)
    s = run_training(config("train.steps=2", "train.checkpoint_every=0", "train.overwrite=true"), run)
    assert s["status"] == "ok" and not (run / LOCK).exists()
    (run / LOCK).write_text("stale")
    r = cli("report", str(tmp_path))
    assert r.returncode == 0 and LOCK not in r.stdout + r.stderr, r.stdout + r.stderr


# -- the ledger is the authority on ε ----------------------------------------------------------------------

def damage(folder, how: str) -> int:
    """Damage privacy.jsonl (start, steps 1-4, end) one way; returns the number of the line made unreadable."""
    lines = ledger_lines(folder)
    assert lines[-1] == b"" and len(lines) == 7
    if how == "garbage":
        lines.insert(3, b"\x00\xff\xfe binary \x80 garbage")
        bad = 4
    elif how == "not-a-number":
        record = json.loads(lines[4])
        record["epsilon"] = "n/a"
        lines[4] = json.dumps(record).encode()
        bad = 5
    else:  # the last line cut short, as a crash mid-write leaves it
        lines = lines[:-2] + [lines[-2][:len(lines[-2]) // 2]]
        bad = 6
    (folder / "privacy.jsonl").write_bytes(b"\n".join(lines))
    return bad


@pytest.mark.parametrize("how", ["garbage", "not-a-number", "cut"])
def test_a_damaged_ledger_is_read_around_and_said(dead, oracle, capsys, how):
    bad = damage(dead, how)
    capsys.readouterr()
    resumed = run_training(config(), dead)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "unreadable line" in line]
    assert len(warnings) == 1 and f"privacy.jsonl: 1 unreadable line(s) skipped (line {bad})" in warnings[0], err
    assert resumed["status"] == "ok" and resumed["resumed_from_step"] == 4
    assert resumed["epsilon_spent"] == oracle["epsilon_spent"]
    records, unreadable = read_ledger(dead)
    assert unreadable == [bad]  # the resume's own lines start on a line of their own, after a cut one too
    assert [r.get("event") for r in records][-4:] == ["resume", None, None, "end"]
    assert (dead / "privacy.jsonl").read_bytes().endswith(b"\n")


def test_the_resume_takes_the_most_any_readable_line_records(dead):
    lines = ledger_lines(dead)
    record = json.loads(lines[3])
    record["epsilon"] = 7.5  # more than this run's six steps spend: a line the ledger holds, so spent
    lines[3] = json.dumps(record).encode()
    (dead / "privacy.jsonl").write_bytes(b"\n".join(lines))
    resumed = run_training(config(), dead)
    assert resumed["epsilon_spent"] == 7.5
    assert json.loads((dead / "summary.json").read_text())["epsilon_spent"] == 7.5


def test_appending_never_lands_on_a_cut_line(tmp_path):
    (tmp_path / "privacy.jsonl").write_bytes(b'{"epsilon": 1.0}\n{"epsil')
    append_privacy(tmp_path, {"epsilon": 2.0})
    records, unreadable = read_ledger(tmp_path)
    assert [r["epsilon"] for r in records] == [1.0, 2.0] and unreadable == [2]


@pytest.mark.parametrize("how", ["missing", "unreadable"])
def test_a_resume_without_a_readable_ledger_is_refused_until_overwritten(dead, cli, how):
    if how == "missing":
        (dead / "privacy.jsonl").unlink()
    else:
        (dead / "privacy.jsonl").write_bytes(b"\x00\x01garbage\n{cut")
    before = files(dead)
    r = cli("train", *OVERRIDES, f"hydra.run.dir={dead}")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    what = "is missing" if how == "missing" else "has no readable line (2 unreadable)"
    assert f"privacy.jsonl {what}" in lines[0] and "train.overwrite=true" in lines[0], lines[0]
    assert files(dead) == before
    s = run_training(config("train.overwrite=true"), dead)  # starts over: its records go, its ledger is new
    assert s["status"] == "ok" and "resumed_from_step" not in s and s["steps_done"] == 6
    records, _ = read_ledger(dead)
    assert records[0]["event"] == "start" and records[-1]["event"] == "end"
    if how == "unreadable":
        assert (dead / "privacy.jsonl").read_bytes().startswith(b"\x00\x01garbage\n{cut\n")  # kept, never rewritten


def test_a_damaged_metrics_file_is_repaired_on_resume(dead, oracle, capsys):
    metrics = dead / "metrics.jsonl"
    lines = metrics.read_bytes().split(b"\n")
    metrics.write_bytes(b"\n".join([lines[0], b"\xff{not json", *lines[1:-2], lines[-2][:7]]))  # cut, no newline
    capsys.readouterr()
    resumed = run_training(config(), dead)
    err = capsys.readouterr().err
    assert resumed["status"] == "ok" and resumed["epsilon_spent"] == oracle["epsilon_spent"]
    said = [line for line in err.splitlines() if "metrics.jsonl" in line]
    assert len(said) == 1 and "2 unreadable line(s) dropped" in said[0], err
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 5, 6, 6]  # step 4's record was the cut line: its step is not run again


@pytest.mark.parametrize("summary", [b"{\"status\": \"ok\", \"ste", b"[]"], ids=["cut", "not-an-object"])
def test_a_damaged_summary_under_skip_done_is_not_done_in_one_line(tmp_path, cli, oracle, made, summary):
    run = tmp_path / "run"
    shutil.copytree(made[1].parent / "oracle", run)  # a finished run
    (run / "summary.json").write_bytes(summary)
    r = cli("train", *OVERRIDES, "train.skip_done=true", f"hydra.run.dir={run}")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "summary.json is unreadable" in lines[0] and "not taken as done (train.skip_done)" in lines[0], lines
    assert "train.overwrite=true replaces it" in lines[-1] and len(lines) == 2, lines
    assert (run / "summary.json").read_bytes() == summary


# -- a full disk ---------------------------------------------------------------------------------------------

def full(*args):
    return OSError(errno.ENOSPC, "No space left on device", *args)


class HalfWritten:
    """A file whose write puts half its bytes on disk and then finds the disk full."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)

    def write(self, data):
        self.f.write(bytes(data[:len(data) // 2]))
        raise full()


def fills_at(monkeypatch, name: str, nth: int, stays: bool = False):
    """The `nth` append to the run folder's `name` from now on (and with `stays`, every later one) half-writes
    and finds the disk full."""
    calls, real = [], open

    def opening(path, *args, **kwargs):
        f = real(path, *args, **kwargs)
        if os.path.basename(path) != name:
            return f
        calls.append(1)
        return HalfWritten(f) if len(calls) == nth or (stays and len(calls) > nth) else f
    monkeypatch.setattr(summary_module, "open", opening, raising=False)


def check_failed_on_a_full_disk(run, summary, path_name):
    assert summary["status"] == "failed", summary
    assert f"{path_name}: the disk is full (writing " in summary["error"], summary["error"]
    assert not [f.name for f in run.iterdir() if f.name.endswith(".tmp")]
    assert read_ledger(run)[1] == [] and (run / "privacy.jsonl").read_bytes().endswith(b"\n")
    assert all(line.endswith(b"}") for line in (run / "metrics.jsonl").read_bytes().split(b"\n")[:-1])


@pytest.mark.parametrize("where", ["checkpoint", "rename", "summary", "metrics", "ledger"])
def test_a_full_disk_fails_the_run_in_one_line_and_keeps_the_checkpoint_and_ledger(tmp_path, monkeypatch, oracle,
                                                                                    where):
    """Each write meets a full disk once, mid-run (after the checkpoint of step 2): the run ends failed naming the
    file, leaves no partial file or line, and resumes from its last good checkpoint to the oracle's ε."""
    run = tmp_path / "run"
    if where in ("checkpoint", "rename"):  # the second save (step 4): in torch.save, or in the rename after it
        saves, real_save, real_replace = [], torch.save, os.replace

        def save(obj, f, *args, **kwargs):
            saves.append(1)
            if len(saves) == 2 and where == "checkpoint":
                f.write(b"partial")
                raise full()
            return real_save(obj, f, *args, **kwargs)

        def replace(src, dst):
            if str(dst).endswith("checkpoint.pt") and len(saves) == 2:
                raise full()
            return real_replace(src, dst)
        monkeypatch.setattr(checkpoint_module.torch, "save", save)
        monkeypatch.setattr(checkpoint_module.os, "replace", replace)
        name = "checkpoint.pt"
    elif where == "summary":  # the summary after step 3 (one before the start's, one per step)
        writes, real_replace = [], os.replace

        def replace(src, dst):
            if str(dst).endswith("summary.json"):
                writes.append(1)
                if len(writes) == 4:
                    raise full()
            return real_replace(src, dst)
        monkeypatch.setattr(summary_module.os, "replace", replace)
        name = "summary.json"
    else:  # the line of step 3
        name = "metrics.jsonl" if where == "metrics" else "privacy.jsonl"
        fills_at(monkeypatch, name, 3 if where == "metrics" else 4)
    with pytest.raises(DiskFull, match=f"{name}: the disk is full"):
        run_training(config(), run)
    monkeypatch.undo()
    s = json.loads((run / "summary.json").read_text())
    check_failed_on_a_full_disk(run, s, name)
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    assert saved["step"] == (2 if where in ("checkpoint", "rename") else s["steps_done"] // 2 * 2)
    resumed = run_training(config(), run)
    assert resumed["status"] == "ok" and resumed["epsilon_spent"] == oracle["epsilon_spent"]


def test_a_disk_that_stays_full_leaves_the_last_summary_whole_in_one_line(tmp_path, monkeypatch, cli):
    """From step 3's ledger line on, every write of the ledger and summary fails: the run's end cannot be recorded,
    and what it wrote before stays readable; the command says so in one line, exit 1."""
    run = tmp_path / "run"
    fills_at(monkeypatch, "privacy.jsonl", 4, stays=True)
    real_replace = os.replace

    def replace(src, dst):  # every summary from step 3's on
        if str(dst).endswith("summary.json") and json.loads(open(src).read())["steps_done"] >= 3:
            raise full()
        return real_replace(src, dst)
    monkeypatch.setattr(summary_module.os, "replace", replace)
    r = cli("train", *OVERRIDES, f"hydra.run.dir={run}")
    monkeypatch.undo()
    said = [line for line in r.stderr.splitlines() if "disk is full" in line]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(said) == 1 and said[0].startswith(f"dpmem: error: run {run} failed: {run / 'privacy.jsonl'}"), said
    s = json.loads((run / "summary.json").read_text())  # the last one written, whole
    assert s["status"] == "running" and s["steps_done"] == 2
    assert read_ledger(run)[1] == [] and [r["steps_done"] for r in read_ledger(run)[0]] == [0, 1, 2]
    assert not [f.name for f in run.iterdir() if f.name.endswith(".tmp")] and not (run / LOCK).exists()


# -- train.skip_done compares configurations; each verb owns its folders -----------------------------------------

def tree(folder) -> dict:
    return {str(f.relative_to(folder)): f.read_bytes() for f in folder.rglob("*") if f.is_file()}


def said(r) -> list[str]:
    return [x for x in r.stderr.splitlines() if x.strip()]


@pytest.fixture
def finished(made, tmp_path):
    """A copy of the oracle's folder: a private run that finished ok (config.yaml, summary, metrics, ledger)."""
    run = tmp_path / "run"
    shutil.copytree(made[1].parent / "oracle", run)
    return run


@pytest.mark.parametrize("change", [["train.lr=0.5"], ["method=dp-sgd"]], ids=["lr", "method"])
def test_skip_done_refuses_a_finished_run_of_another_configuration(finished, cli, change):
    before = tree(finished)
    r = cli("train", *OVERRIDES, *change, "train.skip_done=true", f"hydra.run.dir={finished}")
    lines = said(r)
    assert r.returncode == 2 and len(lines) == 1 and "skipped" not in r.stderr, r.stderr
    assert "finished ok with another configuration (" in lines[0], lines[0]
    assert ("train.lr: " in lines[0] and "-> 0.5" in lines[0]) if change == ["train.lr=0.5"] else "method." in lines[0]
    assert "hydra.run.dir=" in lines[0] and "train.overwrite=true" in lines[0], lines[0]
    assert tree(finished) == before


def test_skip_done_skips_a_finished_run_of_this_configuration(finished, cli):
    before = tree(finished)  # what resuming does not compare (train.checkpoint_every, device, ...) may differ
    r = cli("train", *OVERRIDES, "train.checkpoint_every=3", "train.skip_done=true", f"hydra.run.dir={finished}")
    assert r.returncode == 0 and "is done (status ok, the same configuration), skipped" in r.stderr, r.stderr
    assert tree(finished) == before


def test_skip_done_without_the_runs_config_is_not_done_in_one_line(finished, cli):
    (finished / "config.yaml").unlink()
    before = tree(finished)
    r = cli("train", *OVERRIDES, "train.skip_done=true", f"hydra.run.dir={finished}")
    lines = said(r)
    assert r.returncode == 2 and len(lines) == 2 and "Traceback" not in r.stderr, r.stderr
    assert "no readable config.yaml" in lines[0] and "not taken as done (train.skip_done)" in lines[0], lines
    assert "train.overwrite=true replaces it" in lines[1], lines  # then refused as a finished run's folder
    assert tree(finished) == before


@pytest.mark.parametrize("overwrite", [[], ["train.overwrite=true"]])
@pytest.mark.parametrize("verb", ["audit", "spectrum", "memory", "plan"])
def test_other_verbs_never_write_into_a_training_run_folder(finished, cli, verb, overwrite):
    """Not even with train.overwrite=true (the run would leave the report's composition: its releases are its)."""
    before = tree(finished)
    extra = ["model=roberta-tiny", "data=synthetic"] if verb == "plan" else []
    r = cli(verb, *extra, f"hydra.run.dir={finished}", *overwrite)
    lines = said(r)
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"{finished} holds a training run (its ε ledger" in lines[0] and \
        f"dpmem {verb} never writes into one, whatever train.overwrite says" in lines[0], lines[0]
    assert tree(finished) == before  # its config.yaml still the one its summary belongs to


@pytest.mark.parametrize("verb", ["train", "audit", "spectrum", "memory"])
def test_every_verb_refuses_a_folder_of_other_files_the_current_one_too(tmp_path, cli, verb):
    (tmp_path / "config.yaml").write_text("mine: 1\n")  # a user's own Hydra app
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("mine: 1\n")
    before = tree(tmp_path)
    r = cli(verb, *(OVERRIDES if verb == "train" else ()), "hydra.run.dir=.")
    lines = said(r)
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"{tmp_path} is not empty (.hydra, config.yaml) and holds no dpmem run: dpmem {verb} writes only" \
        in lines[0] and "(hydra.run.dir=...)" in lines[0] and "train.overwrite=true" in lines[0], lines[0]
    assert tree(tmp_path) == before


def test_train_overwrite_writes_into_a_folder_of_other_files(tmp_path, cli):
    (tmp_path / "config.yaml").write_text("mine: 1\n")
    r = cli("train", *OVERRIDES, "hydra.run.dir=.", "train.overwrite=true")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "ok"
    assert "mine" not in (tmp_path / "config.yaml").read_text()


@pytest.mark.parametrize("holder, verb", [("memory", "train"), ("spectrum", "audit"), ("audit", "memory"),
                                          ("memory", "spectrum")])
def test_a_verb_refuses_another_verbs_folder(tmp_path, cli, holder, verb):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / MARK).write_text(f"{holder}\n")
    (folder / "config.yaml").write_text("x: 1\n")
    before = tree(folder)
    r = cli(verb, *(OVERRIDES if verb == "train" else ()), f"hydra.run.dir={folder}")
    lines = said(r)
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"{folder} is a dpmem {holder} folder: dpmem {verb} writes only" in lines[0], lines[0]
    assert tree(folder) == before


def test_owner_tells_each_verbs_folder_by_its_mark_or_its_files(tmp_path):
    cases = {"lock": ({LOCK: ""}, None), "audit": ({"audit.json": "{}"}, "audit"), "sweep": ({"audit.md": ""}, "audit"),
             "memory": ({"memory.json": "{}"}, "memory"), "spectrum": ({"spectrum.json": "{}"}, "spectrum"),
             "analysis": ({"summary.json": '{"status": "ok", "analysis": "spectrum"}'}, "spectrum"),
             "train": ({"summary.json": '{"status": "ok"}'}, "train"), "ledger": ({"privacy.jsonl": ""}, "train"),
             "damaged": ({"summary.json": "{cut"}, "train"), "mine": ({"notes.txt": ""}, "other"),
             "marked": ({MARK: "memory\n", "config.yaml": ""}, "memory"), "empty": ({}, None)}
    for name, (made, expected) in cases.items():
        (tmp_path / name).mkdir()
        for f, text in made.items():
            (tmp_path / name / f).write_text(text)
        assert owner(tmp_path / name) == expected, name
    assert owner(tmp_path / "missing") is None


def test_a_verb_writes_again_into_its_own_folder_and_marks_it(tmp_path, cli):
    args = ("memory", "method=adam", "model.arch.num_hidden_layers=1", "memory.steps=2", f"memory.dir={tmp_path / 'm'}")
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m" / MARK).read_text() == "memory\n" and not (tmp_path / "m" / LOCK).exists()
    assert ".dpmem" not in r.stderr.splitlines()[-1]  # "wrote memory.json, memory.md to ..."
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    r = cli("train", *OVERRIDES, f"hydra.run.dir={tmp_path / 'm'}")  # and train does not write into it
    assert r.returncode == 2 and "is a dpmem memory folder" in r.stderr, r.stderr


@pytest.mark.parametrize("verb", ["audit", "spectrum", "memory"])
def test_other_verbs_take_the_folder_lock(tmp_path, cli, verb):
    lock = FolderLock(tmp_path / "out")
    lock.acquire()  # another process's lock, as far as flock goes (another open file description)
    try:
        r = cli(verb, f"hydra.run.dir={tmp_path / 'out'}")
    finally:
        lock.release()
    lines = said(r)
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "is being written by another dpmem run (pid" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # nothing written (the lock's folder went with it)


@pytest.mark.parametrize("norm", ["-1", "0", "nan", "inf"])
def test_a_non_positive_or_infinite_audit_norm_is_refused_in_one_line(tmp_path, cli, norm):
    r = cli("audit", f"audit.norm={norm}", f"audit.dir={tmp_path / 'a'}")
    lines = said(r)
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "audit.norm" in lines[0] and "must be a finite number > 0" in lines[0], lines[0]
    assert not (tmp_path / "a").exists()


def test_dpmem_report_tells_a_marked_folder_from_a_run_that_died(tmp_path):
    from dpmem.report import runs

    audit = tmp_path / "a"  # an audit that died before its audit.json: its mark says whose folder it is
    (audit / "run").mkdir(parents=True)
    (audit / MARK).write_text("audit\n")
    (audit / "config.yaml").write_text("method:\n  name: dp-adam\n")
    summaries, missing = runs.collect([tmp_path])
    assert summaries == [] and [(m["run_dir"], m["analysis"]) for m in missing] == [(str(audit), "audit")]


def test_a_lock_that_is_a_folder_is_named_rather_than_the_run_folder_called_unwritable(tmp_path):
    (tmp_path / LOCK).mkdir()
    with pytest.raises(FolderRefused) as refused:
        FolderLock(tmp_path).acquire()
    assert refused.value.key == "hydra.run.dir"
    assert f"{tmp_path / LOCK} is a folder" in str(refused.value) and "cannot write into" not in str(refused.value)
    assert (tmp_path / LOCK).is_dir()  # nothing of the user's removed
