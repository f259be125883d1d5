"""Issue 73: a run's record never says less than what its attempts released, whatever stops a resume or happens to
its files: a resume interrupted before it read its ledger, a ledger whose ε fields were scaled down, a unit edited to
user in config.yaml and summary.json alone, a folder whose ledger and summary are gone. ε is checked against
dp-accounting's PLD, built here from the σ and q the run recorded."""

import json
import math
import re
import shutil

import dp_accounting
import pytest
from omegaconf import OmegaConf

from dpmem.engine.trainer import Run, Terminated, run_training
from dpmem.methods import METHODS
from dpmem.privacy.accounting import PLD_DISCRETIZATION
from dpmem.report.labels import USER
from helpers import config, dies_at

# 6 steps of 32 on 160 synthetic images, a checkpoint at step 3: killed in step 5, the lost attempt released 4
TINY = ["method=dp-adam", "model=vit-tiny", "data=synthetic", "data.n_train=160", "data.image_size=8",
        "data.channels=1", "model.arch.hidden_size=16", "model.arch.num_hidden_layers=1",
        "model.arch.num_attention_heads=2", "model.arch.intermediate_size=32", "model.arch.patch_size=4",
        "train.device=cpu", "train.steps=6", "train.checkpoint_every=3", "privacy.epsilon=2", "logging.memory_steps=0"]
NOISE = {"independent": [], "bandmf": ["privacy.noise=bandmf", "privacy.bands=3", "train.sampling=cyclic"]}


def oracle(s: dict, steps: int) -> float:
    """dp-accounting's PLD of `steps` steps of the run of summary `s`: Poisson-subsampled Gaussians of its σ
    accounted per step at q, or under bandmf's cyclic groups ceil(steps/G) of them at the group's rate."""
    rate, count = s["sample_rate"], steps
    if s.get("noise") == "bandmf":
        rate, count = s["group_rate"], math.ceil(steps / s["groups"])
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(s["sigma_accounted"])), count)
    return dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION).compose(
        event).get_epsilon(s["delta"])


def killed(folder, noise="independent") -> dict:
    """A run in `folder` that died in step 5 (steps 1-4 logged in its ledger, its checkpoint at step 3): its
    summary."""
    with pytest.MonkeyPatch.context() as patch:
        dies_at(patch, METHODS["dp-adam"], 5)
        with pytest.raises(RuntimeError, match="went away"):
            run_training(config(*TINY, *NOISE[noise]), folder)
    s = json.loads((folder / "summary.json").read_text())
    assert s["steps_done"] == 4 and (folder / "checkpoint.pt").exists()
    return s


@pytest.fixture(scope="module")
def dead(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dead") / "run"
    return folder, killed(folder)


def ledger(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "privacy.jsonl").read_text().splitlines()]


def copied(dead, tmp_path):
    shutil.copytree(dead[0], tmp_path / "run")
    return tmp_path / "run", dead[1]


@pytest.mark.parametrize("noise,where,stop", [("independent", "restore", KeyboardInterrupt),
                                              ("independent", "ledger", Terminated),
                                              ("bandmf", "ledger", KeyboardInterrupt)])
def test_a_resume_stopped_as_it_starts_records_what_the_lost_attempt_released(tmp_path, monkeypatch, noise, where,
                                                                              stop):
    """Killed after releasing 4 steps (checkpoint at 3), resumed by the same command and stopped (Ctrl-C, SIGTERM)
    as the resume starts: restoring the checkpoint, or reading the ledger while "resuming ... at step 3" prints.
    summary.json and the ledger's end line keep ε of the 4 released steps, never the checkpoint's 3."""
    s = killed(tmp_path / "run", noise)
    released = oracle(s, 4)
    assert released > oracle(s, 3) * 1.01  # what the checkpoint's steps alone give is less
    if where == "restore":
        def stopped(*args):
            raise stop()
        monkeypatch.setattr("dpmem.engine.checkpoint.restore", stopped)
    else:
        calls, real = [], Run._ledger_epsilon

        def stopped(self):
            calls.append(1)
            if len(calls) == 1:
                raise stop()
            return real(self)
        monkeypatch.setattr(Run, "_ledger_epsilon", stopped)
    with pytest.raises(stop):
        run_training(config(*TINY, *NOISE[noise]), tmp_path / "run")
    after = json.loads((tmp_path / "run" / "summary.json").read_text())
    end = ledger(tmp_path / "run")[-1]
    assert after["status"] == end["status"] == "interrupted" and end["event"] == "end"
    assert after["epsilon_spent"] >= released * (1 - 1e-9) and end["epsilon"] >= released * (1 - 1e-9)
    assert after["steps_done"] == end["steps_done"] == 3 and after["steps_released"] == end["steps_released"] == 4


def not_in_the_table(cli, root) -> str:
    r = cli("report", str(root))
    assert r.returncode == 0, r.stderr
    return next(x for x in r.stdout.splitlines() if x.startswith(f"- {root / 'run'}: no summary.json"))


def test_a_ledger_scaled_down_is_shown_beside_the_epsilon_its_config_gives(dead, tmp_path, cli):
    """Every ε of the killed run's ledger × 0.3 and its summary removed: the report's line quotes the ledger's
    figure only beside what the run's σ, q and 4 steps give, named as disagreeing."""
    run, s = copied(dead, tmp_path)
    lines = ledger(run)
    (run / "privacy.jsonl").write_text("".join(json.dumps({**r, "epsilon": r.get("epsilon") and 0.3 * r["epsilon"]})
                                               + "\n" for r in lines))
    (run / "summary.json").unlink()
    text = not_in_the_table(cli, tmp_path)
    scaled = 0.3 * max(r["epsilon"] for r in lines)
    assert f"records epsilon {scaled:.4g} spent over 4 steps, which disagrees with the epsilon " in text, text
    shown = [float(x) for x in re.findall(r"epsilon (\d+\.?\d*)", text)]
    assert max(shown) == pytest.approx(oracle(s, 4), rel=1e-3), text


def test_a_unit_edited_to_user_is_the_weaker_claim_and_said_so(dead, tmp_path, cli):
    """config.yaml and summary.json of a record-level run edited to unit user (its ledger still says record): the
    table shows its ε per record, and one line says why."""
    run, _ = copied(dead, tmp_path)
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.privacy.unit = "user"
    OmegaConf.save(cfg, run / "config.yaml")
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "unit": "user"}))
    assert {r.get("unit") for r in ledger(run)} == {"record"}
    r = cli("report", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = [x for x in r.stdout.splitlines() if x.startswith("| dp-adam")]
    assert rows and not any(USER.strip() in x for x in rows), rows
    said = [x for x in r.stdout.splitlines() if x.startswith(f"- {run}: ") and "unit user" in x]
    want = (f"- {run}: config.yaml and summary.json say unit user where privacy.jsonl says unit record: its ε is "
            "shown and composed per record, the weaker claim")
    assert said == [want], r.stdout


def test_a_run_whose_ledger_and_summary_are_gone_is_shown_with_the_steps_and_epsilon_its_files_give(dead, tmp_path,
                                                                                                   cli):
    """privacy.jsonl and summary.json deleted, checkpoint.pt (step 3) and metrics.jsonl (to step 4) left: the run
    is listed as unfinished at 4/6 steps, with ε from its config.yaml over the 6 steps it plans (no record says
    fewer were released), never "died before it started"."""
    run, s = copied(dead, tmp_path)
    (run / "privacy.jsonl").unlink()
    (run / "summary.json").unlink()
    text = not_in_the_table(cli, tmp_path)
    assert "died before it started" not in text
    assert "4/6 steps (metrics.jsonl to step 4, checkpoint.pt at step 3)" in text, text
    epsilon = float(re.search(r"; epsilon (\d+\.?\d*) ", text).group(1))
    assert epsilon == pytest.approx(oracle(s, 6), rel=1e-3) and epsilon >= oracle(s, 4), text
