"""Issue 64: ε that no edit, overwrite or resume lowers. `dpmem report` composes a folder's releases at the
conservative end of what its ledger and its config.yaml say; a resume recomputes ε from its configuration for every
accountant, rc included; a resume refuses training data that changed. ε is checked against dp-accounting's PLD,
computed here from the unedited ledgers."""

import json
import shutil

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld

from dpmem.engine.folder import FolderRefused
from dpmem.engine.trainer import run_training
from dpmem.methods import METHODS
from dpmem.privacy.accounting import PLD_DISCRETIZATION
from helpers import config, dies_at

TINY = ["method=dp-adam", "train.device=cpu", "model=vit-tiny", "data.image_size=8", "train.batch_size=64",
        "train.steps=3", "privacy.epsilon=2", "logging.memory_steps=0"]


def ledger(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "privacy.jsonl").read_text().splitlines()]


def write_ledger(folder, lines) -> None:
    (folder / "privacy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    """Three releases on digits: run a, and run b started twice with one configuration (the first attempt abandoned
    by train.overwrite=true); and dp-accounting's PLD of the three composed, from the unedited ledgers."""
    root = tmp_path_factory.mktemp("search")
    for name, again in (("a", []), ("b", []), ("b", ["train.overwrite=true"])):
        run_training(config(*TINY, *again), root / name)
    ends = [r for name in ("a", "b") for r in ledger(root / name) if r.get("event") == "end"]
    assert len(ends) == 3 and all(r["status"] == "ok" and r["steps_done"] == 3 for r in ends)
    acc = pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    for r in ends:
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            r["sample_rate"], dp_accounting.GaussianDpEvent(r["sigma_accounted"])), r["steps_done"]))
    return root, acc.get_epsilon(ends[0]["delta"])


def composed(cli, root) -> tuple[float, str]:
    r = cli("report", str(root))
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("- digits:"))
    assert "3 private releases on the same training data (2 runs + 1 abandoned attempt)" in line, line
    return float(line.split("ε = ")[1].split(" ")[0]), r.stdout


def abandoned(lines: list[dict], edit) -> list[dict]:
    """The lines with `edit` made to those of the first (abandoned) attempt."""
    first = lines[0]["attempt"]
    return [edit(r) if r["attempt"] == first else r for r in lines]


EDITS = {  # name: (what is done to b's folder, what the report says of it)
    "abandoned σ × 3": (lambda b: write_ledger(b, abandoned(ledger(b), lambda r: {
        **r, "sigma": 3 * r["sigma"], "sigma_accounted": 3 * r["sigma_accounted"]})), "privacy.jsonl says σ "),
    "abandoned q × 0.1": (lambda b: write_ledger(b, abandoned(ledger(b), lambda r: {
        **r, "sample_rate": 0.1 * r["sample_rate"]})), "privacy.jsonl says q "),
    "abandoned steps 1": (lambda b: write_ledger(b, abandoned(ledger(b), lambda r: {
        **r, "steps_done": min(r["steps_done"], 1)})), "privacy.jsonl says steps 1 where its config.yaml gives 3"),
    "abandoned ε ÷ 3": (lambda b: write_ledger(b, abandoned(ledger(b), lambda r: {
        **r, "epsilon": r["epsilon"] / 3})), "privacy.jsonl says ε "),
    "steps lowered, summary deleted": (lambda b: (write_ledger(b, [{**r, "steps_done": min(r["steps_done"], 1)}
                                                                 for r in ledger(b)]),
                                                  (b / "summary.json").unlink()), "steps 1 where its config.yaml"),
    "lines deleted, summary deleted": (lambda b: (write_ledger(b, [r for r in ledger(b) if r.get("event") == "start"]),
                                                  (b / "summary.json").unlink()), "steps 0 where its config.yaml"),
}


def test_the_report_composes_the_unedited_search(search, cli):
    root, want = search
    got, out = composed(cli, root)
    assert got == pytest.approx(want, rel=5e-3)
    assert "composed at the config's" not in out


@pytest.mark.parametrize("edit", EDITS)
def test_no_edit_of_a_ledger_lowers_the_composed_epsilon(search, cli, tmp_path, edit):
    """Each edit of b's records (its abandoned attempt's lines, or its run's with the summary gone) leaves the
    composition at dp-accounting's of the unedited releases, and the report says in one line where it took the
    config's."""
    root, want = search
    shutil.copytree(root, tmp_path / "copy")
    change, said = EDITS[edit]
    change(tmp_path / "copy" / "b")
    got, out = composed(cli, tmp_path / "copy")
    assert got == pytest.approx(want, rel=5e-3)
    notes = [x for x in out.splitlines() if x.startswith(f"- {tmp_path / 'copy' / 'b'}: ") and "config.yaml" in x]
    assert len(notes) == 1 and said in notes[0] and "composed at the config's" in notes[0], out


def test_a_folder_without_config_is_composed_from_its_ledger_as_written_and_says_so(search, cli, tmp_path):
    root, want = search
    shutil.copytree(root, tmp_path / "copy")
    (tmp_path / "copy" / "b" / "config.yaml").unlink()
    got, out = composed(cli, tmp_path / "copy")
    assert got == pytest.approx(want, rel=5e-3)
    assert f"{tmp_path / 'copy' / 'b'}: it has no config.yaml: composed from its privacy.jsonl and summary as " \
           "written" in out


# ε = 0.1 and k = 32 probes: the rc accountant calibrates and accounts them in a fraction of its time at ε = 2 and
# k = 8 (what is tested is which ε the report and a resume take, not its size)
RC = ["method=dp-sgd-rc", "method.k=32", "train.device=cpu", "model=vit-tiny", "data.image_size=8",
      "train.batch_size=64", "privacy.epsilon=0.1", "logging.memory_steps=0", "train.steps=6"]


def test_an_rc_ledgers_epsilon_divided_is_not_what_the_report_shows(cli, tmp_path):
    """Two dp-sgd-rc runs (whose composition the report does not compute): each ε ÷ 3 in their ledgers and their
    summaries deleted, the report's ε of each is still what they spent (rc's ε is recomputed from the config)."""
    spent = []
    for name in ("a", "b"):
        spent.append(run_training(config(*RC), tmp_path / name)["epsilon_spent"])
        write_ledger(tmp_path / name, [{**r, "epsilon": r["epsilon"] / 3} for r in ledger(tmp_path / name)])
        (tmp_path / name / "summary.json").unlink()
    r = cli("report", str(tmp_path))
    line = next(x for x in r.stdout.splitlines() if x.startswith("- digits:"))
    assert float(line.split("each ε ≤ ")[1].split(";")[0]) == pytest.approx(max(spent), rel=1e-3), line
    assert r.stdout.count("privacy.jsonl says ε ") == 2


def test_an_rc_resume_never_reports_less_than_a_line_logged(tmp_path, monkeypatch, capsys):
    """A dp-sgd-rc run killed in step 5 (checkpoint at 3, steps 1-4 logged), its lines' ε × 0.3 and its summary
    deleted: resumed, its ε is never below what step 4 spent."""
    real_step = dies_at(monkeypatch, METHODS["dp-sgd-rc"], 5)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config(*RC, "train.checkpoint_every=3"), tmp_path)
    monkeypatch.setattr(METHODS["dp-sgd-rc"], "step", real_step)
    lines = ledger(tmp_path)
    logged = max(r["epsilon"] for r in lines)
    assert max(r["steps_done"] for r in lines) == 4 and logged > 0
    write_ledger(tmp_path, [{**r, "epsilon": 0.3 * r["epsilon"]} for r in lines])
    (tmp_path / "summary.json").unlink()
    dies_at(monkeypatch, METHODS["dp-sgd-rc"], 1)  # resumed at step 3, it dies at once: ε is what was spent before
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config(*RC, "train.checkpoint_every=3"), tmp_path)
    monkeypatch.setattr(METHODS["dp-sgd-rc"], "step", real_step)
    assert json.loads((tmp_path / "summary.json").read_text())["epsilon_spent"] >= logged * (1 - 1e-9)
    assert "the larger is kept" in capsys.readouterr().err
    resumed = run_training(config(*RC, "train.checkpoint_every=3"), tmp_path)  # and goes on to the end
    assert resumed["status"] == "ok" and min(r["epsilon"] for r in ledger(tmp_path)[len(lines) + 2:]) >= logged


def died_on(folder, monkeypatch, *overrides):
    """A dp-adam run in `folder` that died in step 3 with its checkpoint of step 2."""
    real_step = dies_at(monkeypatch, METHODS["dp-adam"], 3)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(config(*overrides, "train.checkpoint_every=2"), folder)
    monkeypatch.setattr(METHODS["dp-adam"], "step", real_step)


def records(folder):
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


def test_a_resume_refuses_a_csv_that_changed(tmp_path, monkeypatch):
    import pandas as pd
    from text_fixtures import make_tokenizer
    tok = make_tokenizer(tmp_path / "tok", "roberta")
    data = tmp_path / "reviews.csv"
    rows = {"text": [f"a good film {i}" if i % 2 else f"a bad film {i}" for i in range(40)], "label": [0, 1] * 20}
    pd.DataFrame(rows).to_csv(data, index=False)
    run = ["method=dp-adam", "train.device=cpu", "model=roberta-tiny", f"model.tokenizer={tok}", "data=csv",
           f"data.path={data}", "train.batch_size=8", "privacy.epsilon=2", "logging.memory_steps=0"]
    died_on(tmp_path / "run", monkeypatch, *run)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["data_fingerprint"]
    pd.DataFrame({**rows, "text": [t.replace("film", "movie") for t in rows["text"]]}).to_csv(data, index=False)
    before = records(tmp_path / "run")
    with pytest.raises(FolderRefused, match=f"data.path={data} changed since") as refused:
        run_training(config(*run, "train.checkpoint_every=2"), tmp_path / "run")
    assert refused.value.key == "train.resume" and len(str(refused.value).splitlines()) == 1
    assert records(tmp_path / "run") == before


def test_a_resume_refuses_a_shrunk_npz_and_resumes_an_unchanged_one(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    data = tmp_path / "images.npz"
    x, y = rng.integers(0, 256, (200, 8, 8, 3), dtype=np.uint8), np.arange(200) % 4
    np.savez(data, x=x, y=y)
    run = [*TINY, "train.steps=5", "train.batch_size=32", "data=npz", f"data.path={data}"]
    died_on(tmp_path / "run", monkeypatch, *run)
    np.savez(data, x=x[:150], y=y[:150])
    with pytest.raises(FolderRefused, match=f"data.path={data} changed since"):
        run_training(config(*run, "train.checkpoint_every=2"), tmp_path / "run")
    np.savez(data, x=x, y=y)  # put back: it resumes
    resumed = run_training(config(*run, "train.checkpoint_every=2"), tmp_path / "run")
    assert resumed["status"] == "ok" and resumed["resumed_from_step"] == 2


def test_a_checkpoint_without_a_fingerprint_resumes_with_a_warning(tmp_path, monkeypatch, capsys):
    import torch
    died_on(tmp_path, monkeypatch, *TINY, "train.steps=5", "train.batch_size=32")
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    del state["summary"]["data_fingerprint"]  # as an older dpmem wrote it
    torch.save(state, tmp_path / "checkpoint.pt")
    resumed = run_training(config(*TINY, "train.steps=5", "train.batch_size=32", "train.checkpoint_every=2"), tmp_path)
    assert resumed["status"] == "ok" and resumed["resumed_from_step"] == 2
    assert "records no fingerprint of its training data" in capsys.readouterr().err
