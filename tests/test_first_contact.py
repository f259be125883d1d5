"""What a new user's mistakes meet: one line naming the key and the fix, nothing written that was not asked for,
and no setting silently overridden (the report's damaged inputs, dpmem plan's base configuration, train's
settings that used to pass without a word)."""

import json
import os
from pathlib import Path


from test_inputs import one_error

TINY = ["model=vit-tiny", "data.image_size=8", "train.steps=2", "train.batch_size=64", "logging.progress=false",
        "logging.memory_steps=0"]


def trained(cli, *overrides, folder="run"):
    """A finished tiny run in `folder` (relative to the test's folder, where `cli` runs), its summary."""
    r = cli("train", *TINY, *overrides, f"hydra.run.dir={folder}")
    assert r.returncode == 0, r.stderr
    return json.loads((Path(folder) / "summary.json").read_text())


def test_the_report_reads_past_a_config_that_is_not_yaml_and_a_ledger_that_is_a_folder(cli, tmp_path):
    trained(cli, folder="runs/a")
    trained(cli, "train.seed=1", folder="runs/b")
    (tmp_path / "runs" / "a" / "config.yaml").write_text("{not: [yaml")
    (tmp_path / "runs" / "b" / "privacy.jsonl").unlink()
    (tmp_path / "runs" / "b" / "privacy.jsonl").mkdir()
    r = cli("report", "runs")
    assert r.returncode == 0, r.stderr
    assert "config.yaml is unreadable (" in r.stderr and "privacy.jsonl is not a file" in r.stderr
    assert "Traceback" not in r.stderr and (tmp_path / "runs" / "report" / "report.md").exists()


def test_the_reports_output_a_file_or_a_read_only_folder_is_one_line(cli, tmp_path, monkeypatch):
    trained(cli, folder="runs/a")
    (tmp_path / "file").write_text("mine")
    one_error(cli("report", "runs", "--out", "file"), "--out file is a file")
    assert (tmp_path / "file").read_text() == "mine"
    if os.geteuid() == 0:  # root writes anywhere (CI's case): the folder's refusal as the OS gives it
        from dpmem.report import runs

        def refused(out, *args):
            raise PermissionError(13, "Permission denied", str(out))
        monkeypatch.setattr(runs, "write", refused)
    else:
        os.chmod(tmp_path / "runs", 0o555)
    try:
        one_error(cli("report", "runs"), "cannot write the report into runs/report (Permission denied)", "--out")
    finally:
        os.chmod(tmp_path / "runs", 0o755)


def test_training_into_a_folder_whose_ledger_is_a_folder_is_one_line(cli, tmp_path):
    (tmp_path / "run" / "privacy.jsonl").mkdir(parents=True)
    r = cli("train", *TINY, "hydra.run.dir=run")
    one_error(r, "hydra.run.dir", "privacy.jsonl is not a file")


def test_static_shapes_false_under_compile_is_refused_and_a_flipped_compile_resumes(cli, tmp_path):
    r = cli("train", *TINY, "train.compile=true", "train.static_shapes=false", "hydra.run.dir=x")
    one_error(r, "train.static_shapes", "a compiled step has one shape")
    from dpmem.engine.folder import fingerprint
    from helpers import config
    eager, compiled = config("train.compile=false"), config("train.compile=true", "train.compile_backend=eager")
    assert fingerprint(eager) == fingerprint(compiled)  # a checkpoint of one resumes as the other


def test_a_loss_bound_that_clips_every_loss_to_nothing_is_said_once(cli, tmp_path):
    r = cli("train", *TINY, "privacy.loss_bound=1e-9", "hydra.run.dir=x")
    assert r.returncode == 0 and r.stderr.count("privacy.loss_bound: 1e-09 clips every per-sample loss") == 1


def test_train_loss_none_records_no_loss_on_a_non_private_run_either(cli, tmp_path):
    s = trained(cli, "method=adam", "privacy=none", "privacy.train_loss=none")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert s["train_loss"] is None and not any("loss" in x or "loss_outside_epsilon" in x for x in lines)


def test_a_non_ascii_value_and_unquoted_candidates_say_how_to_quote(cli, tmp_path):
    one_error(cli("train", *TINY, "hydra.run.dir=ö/x"), "override", "beyond ASCII is quoted for Hydra")
    one_error(cli("plan", "model=roberta-tiny", "plan.candidates=[method=grape]"), "override",
              'quote each candidate', '"method=grape"')


def test_plan_refuses_an_unreachable_budget_and_a_training_runs_folder_before_planning(cli, tmp_path):
    r = cli("plan", "model=roberta-tiny", "data=synthetic", "privacy.epsilon=1e9", "plan.dir=p")
    one_error(r, "privacy.epsilon", "looser than the epsilon of the least noise")
    assert not (tmp_path / "p").exists()
    trained(cli, "train.steps=1", folder="dead")
    before = sorted(p.name for p in (tmp_path / "dead").iterdir())
    r = cli("plan", "model=roberta-tiny", "data=synthetic", "plan.dir=dead", "train.overwrite=true")
    one_error(r, "plan.dir", "holds a training run (its ε ledger, privacy.jsonl, records what it released): "
              "dpmem plan never writes into one")
    assert sorted(p.name for p in (tmp_path / "dead").iterdir()) == before


def test_ctrl_c_in_dpmem_plan_keeps_the_candidates_planned_and_ends_in_one_line(cli, tmp_path, monkeypatch):
    """The second candidate is interrupted (Ctrl-C): the first one's plan is written, exit 130, no traceback."""
    from dpmem.engine import chooser
    real, calls = chooser.candidate, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(chooser, "candidate", interrupted)
    r = cli("plan", "model=roberta-tiny", "data=synthetic", "data.seq_len=16", "train.batch_size=16",
            "memory.budget=64MiB", 'plan.candidates=["method=dp-adam","method=grape"]', "plan.checkpointing=[false]",
            "plan.dir=p")
    assert r.returncode == 130 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last == f"dpmem plan: interrupted after 1 planned candidate(s); wrote them to {tmp_path / 'p'}"
    assert [row["method"] for row in json.loads((tmp_path / "p" / "plan.json").read_text())["rows"]] == ["dp-adam"]


def test_a_spectrum_layer_pattern_that_matches_nothing_names_spectrum_layers_and_leaves_no_folder(cli, tmp_path):
    r = cli("spectrum", "mode=layer", "spectrum.layers=[nomatch*]", "train.steps=2", "spectrum.steps=[1]",
            "spectrum.dir=sp")
    one_error(r, "spectrum.layers", "matches no projectable layer")
    assert not (tmp_path / "sp").exists()


def test_ctrl_c_between_a_sweeps_runs_ends_in_one_line(cli, tmp_path, monkeypatch):
    """Ctrl-C in Hydra's launcher, outside any run (which records its own): exit 130, one line, no traceback."""
    import dpmem.cli

    def interrupted(cfg):
        raise KeyboardInterrupt
    monkeypatch.setattr(dpmem.cli, "run_job", interrupted)
    r = cli("train", "-m", *TINY, "train.seed=1,2", "hydra.sweep.dir=s")
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    one_line = r.stderr.strip().splitlines()
    assert len(one_line) == 1 and one_line[0].startswith("dpmem: interrupted (Ctrl-C)"), r.stderr
