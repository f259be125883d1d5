"""Fault tolerance: a run that dies resumes from its last checkpoint to the very parameters and ε of a run that
never died (the oracle), for every method; a finished run is skipped by a re-launched sweep."""

import json
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir

from dpmem.composition import CONF_DIR
from dpmem.engine.folder import FolderRefused
from dpmem.engine.trainer import run_training
from dpmem.methods import METHODS
from helpers import INDUCTOR, dies_at, kept_runs

SMALL = ["model.arch.hidden_size=16", "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2",
         "model.arch.intermediate_size=32", "model.arch.patch_size=4"]
# ε = 0.1: a large σ, which the accountants calibrate and account in a fraction of the time they take at ε = 8
# (what is tested is that ε after resuming is the uninterrupted run's, not its size)
PRIVACY = ["privacy.epsilon=0.1", "privacy.noise_seed=3", "privacy.sampler_seed=3"]
PROJECTED = ("grape", "galore-dp-naive")  # the methods with a rank and a refresh interval (refreshed mid-run here)


def config(method, *overrides):
    own = ["method.refresh=2", "method.rank=4"] if method in PROJECTED else []
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=[f"method={method}", "train.steps=6", "train.batch_size=32",
                                            "logging.progress=false", "logging.every=1", "logging.memory_steps=0",
                                            *PRIVACY, *own, *SMALL, *overrides])


@pytest.mark.parametrize("method", ["adam", "dp-adam", "grape", "galore-dp-naive", "dpzero", "dp-sgd-rc"])
def test_a_run_that_dies_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, method):
    captured = kept_runs(monkeypatch)
    lr = ["train.lr=1e-4"] if method == "dpzero" else []
    oracle = run_training(config(method, *lr), tmp_path / "oracle")

    cls = METHODS[method]
    real_step = dies_at(monkeypatch, cls, 5)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config(method, "train.checkpoint_every=2", *lr), tmp_path / "resumed")
    dead = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert dead["status"] == "failed" and dead["steps_done"] == 4
    assert (tmp_path / "resumed" / "checkpoint.pt").exists()

    after = []

    def counted(self, micro, loss_fn):
        after.append(1)
        return real_step(self, micro, loss_fn)
    monkeypatch.setattr(cls, "step", counted)
    resumed = run_training(config(method, "train.checkpoint_every=2", *lr), tmp_path / "resumed")
    assert len(after) == 2  # steps 5 and 6 only: the other four came from the checkpoint
    assert resumed["status"] == "ok" and resumed["resumed_from_step"] == 4 and resumed["steps_done"] == 6
    assert resumed["epsilon_spent"] == oracle["epsilon_spent"]
    for (name, a), b in zip(captured["oracle"].model.named_parameters(), captured["resumed"].model.parameters()):
        assert torch.equal(a, b), name
    lines = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6, 6]  # the lost step 5 is not recorded twice
    assert not (tmp_path / "resumed" / "checkpoint.pt").exists()  # finished: nothing to resume


def losses(folder):
    return {r["step"]: r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.mark.long
@INDUCTOR
@pytest.mark.parametrize("noise", [[], ["privacy.noise=bandmf", "privacy.bands=2", "train.sampling=cyclic"]],
                         ids=["independent", "bandmf"])
def test_a_compiled_run_that_dies_resumes_bit_for_bit(tmp_path, monkeypatch, noise):
    """Issue 73: a resumed process's first step ran eager (the coverage check) where the uninterrupted run's was
    compiled, so its redone steps differed by float rounding from what the lost attempt had logged with the same
    noise. Each process now rehearses the check on a micro-batch it releases nothing of, and every step is
    compiled (by inductor: its code rounds otherwise than the eager step)."""
    captured = kept_runs(monkeypatch)
    compiled = ["train.compile=true", "train.device=cpu", "train.batch_size=16", *noise]
    oracle = run_training(config("dp-adam", *compiled), tmp_path / "oracle")
    real_step = dies_at(monkeypatch, METHODS["dp-adam"], 4)  # step 3 logged after the checkpoint of step 2: lost
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config("dp-adam", "train.checkpoint_every=2", *compiled), tmp_path / "resumed")
    lost = losses(tmp_path / "resumed")
    monkeypatch.setattr(METHODS["dp-adam"], "step", real_step)
    resumed = run_training(config("dp-adam", "train.checkpoint_every=2", *compiled), tmp_path / "resumed")
    assert resumed["status"] == "ok" and resumed["resumed_from_step"] == 2, resumed.get("error")
    assert resumed["epsilon_spent"] == oracle["epsilon_spent"] and resumed["noise"] == oracle["noise"]
    assert lost[3] == losses(tmp_path / "resumed")[3]  # the redone step releases what the lost attempt did
    assert losses(tmp_path / "resumed") == losses(tmp_path / "oracle")
    for (name, a), b in zip(captured["oracle"].model.named_parameters(), captured["resumed"].model.parameters()):
        assert torch.equal(a, b), name


def records(folder):
    """dpmem's files in a run folder (Hydra's own .hydra/ is rewritten by every launch)."""
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


def died_after_a_checkpoint(folder, monkeypatch):
    """A dp-adam run in `folder` that died at step 3 with its checkpoint of step 2."""
    real_step = dies_at(monkeypatch, METHODS["dp-adam"], 3)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config("dp-adam", "train.checkpoint_every=2"), folder)
    monkeypatch.setattr(METHODS["dp-adam"], "step", real_step)
    assert json.loads((folder / "summary.json").read_text())["steps_done"] == 2


def test_a_checkpoint_of_another_configuration_is_refused_and_the_records_kept(tmp_path, monkeypatch):
    died_after_a_checkpoint(tmp_path, monkeypatch)
    before = records(tmp_path)
    with pytest.raises(FolderRefused, match=r"another configuration \(train.lr: 0.01 -> 0.5\)"):
        run_training(config("dp-adam", "train.checkpoint_every=2", "train.lr=0.5"), tmp_path)
    assert records(tmp_path) == before  # summary, metrics, config.yaml and checkpoint as they were


@pytest.mark.parametrize("damage", [b"", b"not a checkpoint", "truncated"])
def test_a_corrupt_checkpoint_is_named_and_the_records_kept(tmp_path, monkeypatch, damage):
    died_after_a_checkpoint(tmp_path, monkeypatch)
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(path.read_bytes()[:1000] if damage == "truncated" else damage)
    before = records(tmp_path)
    with pytest.raises(FolderRefused, match="checkpoint.pt is not a readable checkpoint"):
        run_training(config("dp-adam", "train.checkpoint_every=2"), tmp_path)
    assert records(tmp_path) == before


@pytest.mark.parametrize("how", [[], ["train.resume=false"]], ids=["finished", "resume-false"])
def test_a_folder_with_a_run_is_not_overwritten_unless_asked(tmp_path, monkeypatch, how):
    if how:  # a checkpoint that is not to be resumed
        died_after_a_checkpoint(tmp_path, monkeypatch)
    else:
        run_training(config("adam", "train.steps=2"), tmp_path)
    before = records(tmp_path)
    with pytest.raises(FolderRefused, match="train.overwrite=true replaces it"):
        run_training(config("adam", "train.steps=2", *how), tmp_path)
    assert records(tmp_path) == before
    summary = run_training(config("adam", "train.steps=2", "train.overwrite=true", *how), tmp_path)
    assert summary["status"] == "ok" and not (tmp_path / "checkpoint.pt").exists()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [r["step"] for r in map(json.loads, lines) if "loss" in r] == [1, 2]  # this run's records alone


def test_an_empty_run_folder_is_refused(cli, tmp_path):
    r = cli("train", "hydra.run.dir=", "train.steps=1")
    assert r.returncode == 2 and "hydra.run.dir" in r.stderr and not (tmp_path / "summary.json").exists(), r.stderr


def test_a_refused_folder_keeps_hydras_records_and_a_late_config_error_leaves_no_folder(cli, tmp_path):
    """Hydra makes the run folder before dpmem can look into it: its .hydra/ is written only once the folder is
    claimed and the run prepared, so a refusal touches nothing, and an error found then leaves no empty folder."""
    tiny = ["method=adam", "privacy=none", "train.steps=2", "train.batch_size=32", "logging.progress=false"]
    assert cli("train", *tiny, "hydra.run.dir=run").returncode == 0
    every = {f.relative_to(tmp_path): f.read_bytes() for f in (tmp_path / "run").rglob("*") if f.is_file()}
    assert {str(f) for f in every} == {"run/.hydra/config.yaml", "run/.hydra/hydra.yaml", "run/.hydra/overrides.yaml",
                                       "run/config.yaml", "run/metrics.jsonl", "run/summary.json"}  # no empty log
    assert "train.steps=2" in (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()
    r = cli("train", *tiny, "train.lr=0.5", "hydra.run.dir=run")
    assert r.returncode == 2 and "train.overwrite=true replaces it" in r.stderr, r.stderr
    assert {f.relative_to(tmp_path): f.read_bytes() for f in (tmp_path / "run").rglob("*") if f.is_file()} == every
    r = cli("train", *tiny, "train.batch_size=100000", "hydra.run.dir=new/run")  # found once the data is read
    assert r.returncode == 2 and "larger than the training set" in r.stderr, r.stderr
    assert not (tmp_path / "new" / "run").exists()


def test_a_relaunched_sweep_skips_runs_that_finished(cli, tmp_path):
    args = ["train", "-m", "method=adam,dp-adam", *PRIVACY, "train.steps=2", "train.batch_size=32",
            "logging.progress=false", "logging.memory_steps=0", "train.skip_done=true",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    done = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(done) == 2
    stamps = [f.stat().st_mtime_ns for f in done]
    # one of them is marked unfinished (and has no checkpoint): the re-launch keeps its record unless told to
    # overwrite it, then runs it again, and skips the other either way
    s = json.loads(done[1].read_text())
    s["status"] = "interrupted"
    done[1].write_text(json.dumps(s))
    kept = cli(*args)
    assert kept.returncode != 0 and "refused" in kept.stderr and "train.overwrite=true" in kept.stderr
    assert json.loads(done[1].read_text())["status"] == "interrupted"
    again = cli(*args, "train.overwrite=true")
    assert again.returncode == 0, again.stderr
    assert done[0].stat().st_mtime_ns == stamps[0]
    assert json.loads(done[1].read_text())["status"] == "ok"
    assert again.stderr.count("skipped (train.skip_done)") == 1


def test_a_refused_resume_is_one_line_at_the_command_line(cli, tmp_path, monkeypatch):
    died_after_a_checkpoint(tmp_path / "run", monkeypatch)
    before = records(tmp_path / "run")
    overrides = ["method=dp-adam", "train.steps=6", "train.batch_size=32", "logging.progress=false", "logging.every=1",
                 "logging.memory_steps=0", *PRIVACY, *SMALL, "train.checkpoint_every=2"]
    r = cli("train", *overrides, "train.lr=0.5", f"hydra.run.dir={tmp_path / 'run'}")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "train.lr: 0.01 -> 0.5" in lines[0], r.stderr
    assert records(tmp_path / "run") == before


def drawn_batches(monkeypatch) -> list[list[list[int]]]:
    """Every logical batch each run draws from here on: one list of index lists per run (the sampler's own draws,
    skipped ones of a resumed run included)."""
    from dpmem.engine import trainer
    runs, real = [], trainer.make_batches

    def recording(*args, **kwargs):
        runs.append([])
        for index in real(*args, **kwargs):
            runs[-1].append(index.tolist())
            yield index
    monkeypatch.setattr(trainer, "make_batches", recording)
    return runs


def test_a_private_runs_batches_are_secret_unless_seeded_and_a_resumed_run_continues_them(tmp_path, monkeypatch):
    """Issue 34: with train.seed in config.yaml anyone could redraw the batches, and amplification by subsampling
    assumes nobody knows which steps held a record. The sampler's seed comes from the OS (or privacy.sampler_seed,
    said in the summary), lives in the checkpoint alone, and a resumed run goes on drawing what the lost one drew."""
    runs = drawn_batches(monkeypatch)
    secret = ["privacy.epsilon=0.1", "privacy.sampler_seed=null", "privacy.noise_seed=null"]
    for name in ("a", "b"):
        s = run_training(config("dp-adam", *secret), tmp_path / name)
        assert s["derivable_from_config"] == [] and str(s).find("sampler_seed") < 0
    assert runs[0] != runs[1]  # the same config, other batches
    assert [len(b) for b in runs[0]] != [len(b) for b in runs[1]]
    for name in ("c", "d"):
        s = run_training(config("dp-adam", "privacy.sampler_seed=7"), tmp_path / name)
        assert s["derivable_from_config"] == ["batches", "noise"]
    assert runs[2] == runs[3]
    # adam is not private: its batches stay the run seed's, as they were
    run_training(config("adam", "privacy=none"), tmp_path / "e")
    run_training(config("adam", "privacy=none"), tmp_path / "f")
    assert runs[4] == runs[5]
    # dies at step 5 with its checkpoint at 4: the resumed run redraws steps 1-4 (skipped) and goes on from 5 with the
    # batch the lost run had drawn for it
    real_step = dies_at(monkeypatch, METHODS["dp-adam"], 5)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config("dp-adam", *secret, "train.checkpoint_every=2"), tmp_path / "g")
    monkeypatch.setattr(METHODS["dp-adam"], "step", real_step)
    assert "sampler_seed" not in (tmp_path / "g" / "summary.json").read_text()
    resumed = run_training(config("dp-adam", *secret, "train.checkpoint_every=2"), tmp_path / "g")
    assert resumed["resumed_from_step"] == 4 and resumed["steps_done"] == 6
    lost, again = runs[6], runs[7]
    assert again[:5] == lost[:5] and len(again) == 6 and again != runs[0]


def ledger(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "privacy.jsonl").read_text().splitlines()]


def test_the_privacy_ledger_keeps_every_released_step_whatever_the_folder_goes_through(tmp_path, monkeypatch, cli):
    """Issue 34: privacy.jsonl is appended to, never rewritten: a run killed, its checkpoint corrupted, a resume with
    another config refused, the summary deleted, the folder overwritten: every step that was released stays there,
    at the ε dp-accounting gives it; a resumed run's summary takes the most any attempt spent; dpmem report reads it
    where the summary is gone."""
    from tests.test_privacy import direct_epsilon
    run = tmp_path / "run"
    real_step = dies_at(monkeypatch, METHODS["dp-adam"], 5)  # checkpoint at 3, steps 1-4 logged, dies in step 5
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config("dp-adam", "train.checkpoint_every=3"), run)
    monkeypatch.setattr(METHODS["dp-adam"], "step", real_step)
    lines = ledger(run)
    assert [r.get("event") for r in lines] == ["start", None, None, None, None, "end"]
    assert lines[-1]["status"] == "failed" and lines[-1]["steps_done"] == 4
    s = json.loads((run / "summary.json").read_text())
    # the oracle: dp-accounting's PLD for the run's q, δ and steps, and the one Gaussian its gradient (σ) and loss
    # (loss_sigma) releases make on each batch, of multiplier (1/σ² + 1/loss_sigma²)^(-1/2)
    joint = (s["sigma"] ** -2 + s["loss_sigma"] ** -2) ** -0.5
    for r in lines[1:5]:
        assert r["epsilon"] == pytest.approx(direct_epsilon("pld", joint, s["sample_rate"], r["steps_done"],
                                                             s["delta"]), rel=1e-9)
    written = (run / "privacy.jsonl").read_bytes()

    # resumed from step 3, it dies again in its first step: the summary keeps ε of step 4, which was released
    dies_at(monkeypatch, METHODS["dp-adam"], 1)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config("dp-adam", "train.checkpoint_every=3"), run)
    monkeypatch.setattr(METHODS["dp-adam"], "step", real_step)
    s = json.loads((run / "summary.json").read_text())
    assert s["steps_done"] == 3 and s["epsilon_spent"] == lines[4]["epsilon"]
    assert (run / "privacy.jsonl").read_bytes().startswith(written)
    assert [r.get("event") for r in ledger(run)][6:] == ["resume", "end"]
    written = (run / "privacy.jsonl").read_bytes()

    (run / "checkpoint.pt").write_bytes(b"corrupt")  # refused, and refused with another configuration
    for other in ([], ["train.lr=0.5"]):
        with pytest.raises(FolderRefused):
            run_training(config("dp-adam", "train.checkpoint_every=3", *other), run)
        assert (run / "privacy.jsonl").read_bytes() == written
    (run / "summary.json").unlink()
    r = cli("report", str(tmp_path))
    note = f"{run}: no summary.json; its privacy.jsonl records epsilon {lines[4]['epsilon']:.4g} spent over 4 steps"
    assert note in r.stdout, r.stdout + r.stderr
    # the checkpoint moved away (as the refusal says) and the folder overwritten by another configuration: its
    # lines follow the earlier ones
    (run / "checkpoint.pt").unlink()
    run_training(config("dp-adam", "train.lr=0.5", "train.overwrite=true"), run)
    assert (run / "privacy.jsonl").read_bytes().startswith(written)
    new = ledger(run)[8:]
    assert new[0]["event"] == "start" and new[-1]["event"] == "end" and new[-1]["status"] == "ok"
    assert new[0]["config"] != lines[0]["config"] and new[-1]["steps_done"] == 6


@pytest.mark.parametrize("damage", ["halved", "forged start"])
def test_a_damaged_ledger_does_not_lower_the_epsilon_a_resume_records(tmp_path, monkeypatch, capsys, damage):
    """Every line's ε halved, or a forged start line appended, then summary.json deleted: the resumed run still
    records at least what was spent (each line's ε recomputed from its σ, q, δ and steps, against dp-accounting's
    PLD here), and says so where a line disagrees."""
    from tests.test_privacy import direct_epsilon
    run = tmp_path / "run"
    real_step = dies_at(monkeypatch, METHODS["dp-adam"], 5)  # checkpoint at 3, steps 1-4 released
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config("dp-adam", "train.checkpoint_every=3", "privacy.epsilon=2"), run)
    monkeypatch.setattr(METHODS["dp-adam"], "step", real_step)
    lines = ledger(run)
    s = json.loads((run / "summary.json").read_text())
    spent = direct_epsilon("pld", s["sigma_accounted"], s["sample_rate"], 4, s["delta"])
    assert max(r["epsilon"] for r in lines if "epsilon" in r) == pytest.approx(spent, rel=1e-9)
    if damage == "halved":
        lines = [{**r, "epsilon": r["epsilon"] / 2} if r.get("epsilon") else r for r in lines]
        (run / "privacy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    else:
        with open(run / "privacy.jsonl", "a") as f:
            f.write(json.dumps({"event": "start", "steps_done": 0, "epsilon": 0.0}) + "\n")
    (run / "summary.json").unlink()
    dies_at(monkeypatch, METHODS["dp-adam"], 1)  # resumed at step 3, it dies at once: ε is what was spent before
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config("dp-adam", "train.checkpoint_every=3", "privacy.epsilon=2"), run)
    monkeypatch.setattr(METHODS["dp-adam"], "step", real_step)
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["epsilon_spent"] >= spent * (1 - 1e-9)
    assert ("the larger is kept" in capsys.readouterr().err) == (damage == "halved")


def written_before_2026_12_07(state: dict) -> dict:
    """A checkpoint in the layout dpmem wrote until 2026-12-07 (written out here as that code wrote it, not by the
    reader under test): the batches' key was the checkpoint's `sampler_key`, and the mechanism's state and the step's
    keys (where the step draws any) were the method's."""
    mechanism = dict(state.pop("mechanism"))
    sampler, steps = mechanism.pop("sampler"), mechanism.pop("steps", None)
    state["sampler_key"] = sampler["key"]
    state["method"]["mechanism"] = mechanism
    if steps is not None and steps["count"]:
        state["method"]["steps"] = steps
    return state


@pytest.mark.parametrize("method, own", [("dp-adam", ["privacy.noise=bandmf", "privacy.bands=2",
                                                     "train.sampling=cyclic"]), ("dp-sgd-rc", [])])
def test_a_checkpoint_in_the_layout_before_2026_12_07_resumes_as_todays(tmp_path, monkeypatch, method, own):
    """Issue 76: every key is the mechanism's state now (noise, loss, batches, step keys). A checkpoint of the old
    layout resumes to the same weights and ε as the same checkpoint in today's, with secret keys (unseeded: a key
    lost in the reading would draw other batches or noise)."""
    captured = kept_runs(monkeypatch)
    secret = ["privacy.sampler_seed=null", "privacy.noise_seed=null", "train.checkpoint_every=2", *own]
    real_step = dies_at(monkeypatch, METHODS[method], 5)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config(method, *secret), tmp_path / "today")
    monkeypatch.setattr(METHODS[method], "step", real_step)
    shutil.copytree(tmp_path / "today", tmp_path / "old")
    state = torch.load(tmp_path / "old" / "checkpoint.pt", weights_only=True)
    torch.save(written_before_2026_12_07(state), tmp_path / "old" / "checkpoint.pt")
    assert "sampler_key" in torch.load(tmp_path / "old" / "checkpoint.pt", weights_only=True)
    results = {name: run_training(config(method, *secret), tmp_path / name) for name in ("today", "old")}
    assert results["old"]["status"] == "ok" and results["old"]["resumed_from_step"] == 4
    assert results["old"]["epsilon_spent"] == results["today"]["epsilon_spent"]
    for (name, a), b in zip(captured["today"].model.named_parameters(), captured["old"].model.parameters()):
        assert torch.equal(a, b), name
