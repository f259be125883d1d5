"""dpmem report on summaries written here: cells, means and standard errors (against the statistics module), OOM
cells, the best private result per column, the runs that are not in the table, the folders of an analysis, and the
ε of choosing among the runs against dp-accounting's composition of every release."""

import csv
import json
import math
import statistics

import dp_accounting
import pytest
from dp_accounting import pld
from omegaconf import OmegaConf

from dpmem.cli import main
from dpmem.engine.trainer import run_training
from dpmem.privacy.accounting import PLD_DISCRETIZATION
from helpers import config


def summary(root, name, method, data, eps, seed, status="ok", metric=None, **extra):
    d = root / name
    d.mkdir(parents=True)
    s = {"status": status, "method": method, "data": data, "epsilon_target": eps, "private": eps is not None,
         "seed": seed, "metric_name": "accuracy", "metric_final": metric, "steps_done": 10, "steps": 10,
         "error": None, **extra}
    (d / "summary.json").write_text(json.dumps(s))
    (d / "config.yaml").write_text("method: {}\n")


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "sweep"
    grape_sst2 = [0.90, 0.92, 0.95]
    for seed, acc in enumerate(grape_sst2):
        summary(root, f"g{seed}", "grape", "sst2", 2.0, seed, metric=acc)
    for seed, acc in enumerate([0.80, 0.84]):
        summary(root, f"a{seed}", "dp-adam", "sst2", 2.0, seed, metric=acc)
    summary(root, "a-rte", "dp-adam", "rte", 2.0, 0, metric=0.61)
    summary(root, "g-rte", "grape", "rte", 2.0, 0, metric=0.60)
    summary(root, "adam", "adam", "sst2", None, 0, metric=0.97)  # non-private: never marked best
    summary(root, "oom", "dp-adam", "mnli", 2.0, 0, status="oom", error="CUDA out of memory")
    summary(root, "boom", "grape", "mnli", 2.0, 1, status="failed", error="RuntimeError: boom")
    summary(root, "half", "grape", "mnli", 2.0, 2, status="running", steps_done=4)
    (root / "dead").mkdir()
    (root / "dead" / "config.yaml").write_text("x: 1\n")  # died before its first summary
    return root, grape_sst2


def read_csv(path):
    with open(path) as f:
        return {(r["method"], r["epsilon"], r["data"]): r for r in csv.DictReader(f)}


def test_report_cells_means_standard_errors_oom_and_best(runs, capsys):
    root, grape_sst2 = runs
    main(["report", str(root), "--out", str(root / "out")])
    md = (root / "out" / "report.md").read_text()
    assert md == capsys.readouterr().out
    rows = read_csv(root / "out" / "report.csv")
    g = rows[("grape", "2", "sst2")]
    assert int(g["n"]) == 3
    assert float(g["mean"]) == pytest.approx(statistics.fmean(grape_sst2))
    assert float(g["se"]) == pytest.approx(statistics.stdev(grape_sst2) / math.sqrt(3))
    assert g["cell"] == "92.3 ± 1.5" and g["best_private"] == "True"
    assert rows[("dp-adam", "2", "sst2")]["cell"] == "82.0 ± 2.0"
    assert rows[("dp-adam", "2", "rte")]["cell"] == "61.0" and rows[("dp-adam", "2", "rte")]["best_private"] == "True"
    assert rows[("adam", "non-private", "sst2")]["best_private"] == "False"  # 97.0 is higher, but not private
    assert rows[("dp-adam", "2", "mnli")]["cell"] == "OOM"
    assert rows[("grape", "2", "mnli")]["cell"] == "–"  # one failed and one half-finished run: no value
    assert "| grape | 2 | – | **60.0** |" not in md  # 60.0 < 61.0 on rte
    assert "| grape | 2 | – | 60.0 | **92.3 ± 1.5** |" in md
    assert "| dp-adam | 2 | OOM | **61.0** | 82.0 ± 2.0 |" in md
    assert "| adam | non-private |  |  | 97.0 |" in md
    # everything left out is listed with why
    assert "boom: failed (RuntimeError: boom)" in md and "half: running" in md and "4/10 steps" in md
    assert "dead: no summary.json" in md and "Not in the table (3)" in md
    tex = (root / "out" / "report.tex").read_text()
    assert r"\textbf{92.3 $\pm$ 1.5}" in tex and r"\begin{tabular}{llccc}" in tex


def test_report_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path / "nowhere")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path)])
    assert "no summary.json" in capsys.readouterr().err


def test_a_swept_setting_gets_a_row_of_its_own_and_seeds_are_averaged(tmp_path, capsys):
    root = tmp_path / "sweep"
    for k in (10, 100):
        for seed in (0, 1):
            summary(root, f"k{k}s{seed}", "dp-adam", "digits", 8.0, seed, metric=k / 1000 + seed / 100)
            (root / f"k{k}s{seed}" / "config.yaml").write_text(
                f"method:\n  name: dp-adam\n  subspace:\n    k: {k}\ntrain:\n  seed: {seed}\n  lr: 0.001\n")
    main(["report", str(root)])
    rows = read_csv(root / "report" / "report.csv")
    assert set(rows) == {("dp-adam (subspace.k=10)", "8", "digits"), ("dp-adam (subspace.k=100)", "8", "digits")}
    assert float(rows[("dp-adam (subspace.k=100)", "8", "digits")]["mean"]) == pytest.approx(0.105)
    assert rows[("dp-adam (subspace.k=100)", "8", "digits")]["n"] == "2"


def test_figures_are_drawn_from_what_the_runs_hold(tmp_path):
    root = tmp_path / "runs"
    for method in ("grape", "dp-adam"):
        for eps in (1.0, 8.0):
            for seed in (0, 1):
                name = f"{method}-{eps}-{seed}"
                summary(root, name, method, "digits", eps, seed, metric=0.5 + eps / 20 + seed / 100,
                        peak_memory_bytes=2**20 * (1 if method == "grape" else 4) * (seed + 1),
                        physical_batch_size=32 * (seed + 1), peak_memory_source="live_tensors")
                (root / name / "metrics.jsonl").write_text(
                    '{"step": 5, "loss": 2.0}\n{"step": 5, "accuracy": 0.4}\n{"step": 10, "accuracy": 0.6}\n'
                    '{"step": 10, "accuracy": 0.6, "final": true}\n')
    for k, sigma in ((4, 3.0), (32, 1.2)):
        summary(root, f"rc{k}", "dp-sgd-rc", "bbc", 0.7, 0, metric=0.7, sigma=sigma,
                rc_accountant={"k": k, "d": 2048, "estimator": "hutch"})
    main(["report", str(root)])
    out = root / "report"
    for name in ("accuracy_vs_epsilon_digits", "memory_vs_batch", "metric_vs_step", "sigma_vs_k"):
        assert (out / f"{name}.png").stat().st_size > 0 and (out / f"{name}.pdf").exists(), name
    assert not (out / "accuracy_vs_epsilon_bbc.png").exists()  # one epsilon: no curve to draw
    md = (out / "report.md").read_text()
    assert "Figures: accuracy_vs_epsilon_digits.png" in md
    # grape at 32 and 64: 1 and 2 MiB (seeds 0 and 1 ran at those batches); dp-adam 4 and 8 MiB
    assert "| grape | None | 1.0 | 2.0 |" in md and "| dp-adam | None | 4.0 | 8.0 |" in md


def test_published_numbers_are_printed_beside_ours(tmp_path):
    root = tmp_path / "runs"
    summary(root, "g", "grape", "sst2", 6.0, 13, metric=0.9, model="roberta-large")
    summary(root, "a", "adam", "sst2", None, 13, metric=0.95, model="roberta-large")
    summary(root, "d", "grape", "digits", 6.0, 0, metric=0.8, model="vit-tiny")  # no published digits table
    summary(root, "o", "dp-adam", "boolq", 2.0, 0, metric=0.6, model="opt-2.7b")  # the OPT table's 2.7B column
    main(["report", str(root), "--published"])
    md = (root / "report" / "report.md").read_text()
    assert "60.0 [62.5 ± 0.3]" in md  # DP-GRAPE (arXiv 2506.15588) Table 4: DP-Adam eps=2, OPT-2.7B BoolQ
    # DP-GRAPE Table 3: DP-GRAPE eps=6 SST-2 93.3 ± 0.4; AdamW (non-private) 93.1 ± 0.3
    assert "| **80.0** | **90.0 [93.3 ± 0.4]** |" in md and "| 95.0 [93.1 ± 0.3] |" in md
    assert "DP-GRAPE Table 3 (RoBERTa-large" in md


def test_published_lora_and_estimator_rows_are_told_apart(tmp_path):
    root = tmp_path / "runs"
    for name, lora in (("full", "null"), ("lora", "16")):
        summary(root, name, "dp-sgd-rc", "bbc", 9.0, 0, metric=0.95, model="llama-3.2-1b", clipping="hutch")
        (root / name / "config.yaml").write_text(f"model:\n  name: llama-3.2-1b\n  lora:\n    r: {lora}\n")
    summary(root, "pp", "dp-sgd-rc", "bbc", 0.7, 0, metric=0.7, model="llama-3.2-1b", clipping="hutchpp")
    main(["report", str(root), "--published"])
    md = (root / "report" / "report.md").read_text()
    # DP-SGD-RC (Efficient DP-SGD for LLMs with Randomized Clipping) Table 2 (full) 96.1, Table 3 (LoRA) 95.9,
    # Table 4 (Hutch++) 70.59 ± 3.49
    assert "95.0 [96.1]" in md and "95.0 [95.9]" in md and "70.0 [70.59 ± 3.49]" in md


def test_unreadable_and_older_summaries_are_listed_under_the_table_and_the_report_goes_on(tmp_path, capsys):
    root = tmp_path / "runs"
    summary(root, "good", "dp-adam", "digits", 8.0, 0, metric=0.9, peak_memory_bytes=2**20)  # no physical_batch_size
    (root / "broken").mkdir()
    (root / "broken" / "summary.json").write_text('{"status": "ok", "meth')  # cut off mid-write
    (root / "old").mkdir()
    (root / "old" / "summary.json").write_text(json.dumps({"status": "ok", "metric_final": 0.5}))
    main(["report", str(root)])
    out = capsys.readouterr().out
    assert set(read_csv(root / "report" / "report.csv")) == {("dp-adam", "8", "digits")}
    assert "broken: unreadable summary.json (JSONDecodeError" in out and "old: summary.json lacks method, data" in out


def test_releasing_a_search_composes_every_private_run_on_the_same_data(tmp_path, capsys):
    """Issue 37 (part): choosing the best of N private runs on one data set releases all N: the report's ε is their
    composition, here N identical runs = dp-accounting's PLD of N·T steps of the one mechanism."""
    from tests.test_privacy import direct_epsilon
    root, sigma, q, steps, delta = tmp_path / "search", 1.1, 0.05, 40, 1e-5
    for i in range(3):
        summary(root, f"lr{i}", "dp-adam", "sst2", 2.0, 0, metric=0.8 + i / 100, sigma=sigma, sample_rate=q,
                steps_done=steps, delta=delta, accountant="pld", neighbouring="add_remove", sampling="poisson",
                epsilon_spent=1.9, n_train=1000)
    summary(root, "other-data", "dp-adam", "rte", 2.0, 0, metric=0.6, sigma=sigma, sample_rate=q, steps_done=steps,
            delta=delta, accountant="pld", epsilon_spent=1.9)  # alone on its data: nothing to compose
    main(["report", str(root)])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("- sst2:"))
    composed = float(line.split("ε = ")[1].split(" ")[0])
    assert "3 private releases on the same training data (3 runs)" in line and "each ε ≤ 1.9" in line
    assert composed == pytest.approx(direct_epsilon("pld", sigma, q, 3 * steps, delta), rel=5e-3)
    assert "rte:" not in (root / "report" / "report.md").read_text()
    # the same search on data declared public (a proxy) is recorded as such, and composes nothing
    for i in range(3):
        s = json.loads((root / f"lr{i}" / "summary.json").read_text())
        (root / f"lr{i}" / "summary.json").write_text(json.dumps({**s, "data_public": True}))
    main(["report", str(root)])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("- sst2:"))
    assert "declared public (data.public=true)" in line and "ε =" not in line


def test_select_top3_reports_the_best_test_score_of_the_three_lowest_training_losses(tmp_path, capsys):
    """DP-SGD-RC §6: of a search's trials, the three with the lowest training loss, and of those the best test
    score; here the best test score overall (0.99) has the fourth-lowest loss and must not be chosen."""
    root = tmp_path / "search"
    trials = [(0.50, 0.70), (0.40, 0.75), (0.45, 0.72), (0.55, 0.99), (0.90, 0.98)]  # (training loss, accuracy)
    for i, (loss, acc) in enumerate(trials):
        summary(root, f"t{i}", "dp-adam", "bbc", 9.0, 0, metric=acc, train_loss=loss)
    main(["report", str(root), "--select", "top3"])
    out = capsys.readouterr().out
    rows = read_csv(root / "report" / "report.csv")
    assert rows[("dp-adam", "9", "bbc")]["cell"] == "75.0" and rows[("dp-adam", "9", "bbc")]["n"] == "1"
    assert f"{root / 't1'} (training loss 0.4, 5 runs)" in out
    with pytest.raises(SystemExit):
        main(["report", str(root), "--select", "best"])


# -- every release on the same data composed (issue 42, item 3) and analysis folders kept apart (item 4)
Q, DELTA = 0.05, 1e-5


def oracle(releases, delta=DELTA):
    """dp-accounting's PLD of the releases (σ, q, steps) composed one after another: Poisson-sampled Gaussian steps."""
    acc = pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    for sigma, q, steps in releases:
        acc.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return acc.get_epsilon(delta)


def private_run(root, name, sigma, steps, lr=1e-3, seeds=(None, None), ledger=(), **extra):
    """A dp-adam run folder on sst2 as `dpmem train` leaves it: summary.json, config.yaml (train.seed 0, `lr`, the
    privacy seeds (noise, sampler)) and `ledger` as its privacy.jsonl."""
    fields = {"sigma": sigma, "sample_rate": Q, "steps_done": steps, "delta": DELTA, "accountant": "pld",
              "neighbouring": "add_remove", "sampling": "poisson", "n_train": 1000, "epsilon_spent": 1.9,
              "device": "cpu", "world_size": 1, **extra}
    summary(root, name, "dp-adam", "sst2", 2.0, 0, metric=0.8, **fields)
    (root / name / "config.yaml").write_text(OmegaConf.to_yaml({
        "method": {"name": "dp-adam"}, "data": {"name": "sst2", "path": None}, "train": {"seed": 0, "lr": lr},
        "privacy": {"epsilon": 2.0, "noise_seed": seeds[0], "sampler_seed": seeds[1]}}))
    if ledger:
        (root / name / "privacy.jsonl").write_text("".join(json.dumps(x) + "\n" for x in ledger))


def line(attempt, steps, sigma, event=None, **extra):
    """A privacy.jsonl line as an older dpmem wrote it (no sampling, dataset size or neighbouring)."""
    return {"attempt": attempt, **({"event": event} if event else {}), "steps_done": steps, "epsilon": 1.0,
            "delta": DELTA, "sigma": sigma, "sample_rate": Q, "accountant": "pld", "config": "c0ffee", **extra}


def composed_line(out):
    text = next(x for x in out.splitlines() if x.startswith("- sst2:"))
    return text, float(text.split("ε = ")[1].split(" ")[0])


def test_a_repeat_is_a_release_of_its_own(tmp_path, capsys):
    """Two runs of one configuration and train.seed are one sample in the table; their noise and batches came from
    the OS: two releases, both composed."""
    root = tmp_path / "runs"
    private_run(root, "a", 1.1, 40)
    private_run(root, "a-again", 1.1, 30, status="failed", error="RuntimeError: boom")
    private_run(root, "b", 0.9, 20, lr=1e-2)
    main(["report", str(root)])
    out = capsys.readouterr().out
    text, composed = composed_line(out)
    want = [(1.1, Q, 40), (0.9, Q, 20), (1.1, Q, 30)]
    assert composed == pytest.approx(oracle(want), rel=5e-3)
    assert "3 private releases on the same training data (3 runs)" in text
    assert (f"a-again: the same configuration and seed as {root / 'a'}, counted once in the table (its noise and "
            "batches drawn afresh") in out
    assert read_csv(root / "report" / "report.csv")[("dp-adam (lr=0.001)", "2", "sst2")]["n"] == "1"


@pytest.mark.parametrize("seeds", [(5, None), (None, 7), (5, 7)], ids=["noise", "batches", "both"])
def test_a_seeded_run_is_listed_apart_at_infinite_epsilon_never_best_and_never_composed(tmp_path, capsys, seeds):
    """A run whose noise or batches derive from its config.yaml (privacy.noise_seed or sampler_seed) replays for
    anyone holding that file: its ε is ∞ to them. It is shown so, never best private, and composed into no search:
    the search's ε is the two OS-drawn runs' (dp-accounting's PLD, computed here)."""
    root = tmp_path / "runs"
    private_run(root, "seeded", 1.1, 40, lr=1e-1, seeds=seeds)
    private_run(root, "a", 1.1, 40)
    private_run(root, "b", 0.9, 20, lr=1e-2)
    main(["report", str(root)])
    out = capsys.readouterr().out
    rows = read_csv(root / "report" / "report.csv")
    (key,) = [k for k in rows if k[0] == "dp-adam (lr=0.1)"]
    assert key[1] == "∞ to a holder of config.yaml" and rows[key]["derivable_from_config"] == "True"
    assert rows[key]["best_private"] == "False" and all(r["derivable_from_config"] == "False"
                                                        for k, r in rows.items() if k != key)
    text = next(x for x in out.splitlines() if x.startswith("- sst2:") and "ε =" in x)
    assert float(text.split("ε = ")[1].split(" ")[0]) == pytest.approx(oracle([(1.1, Q, 40), (0.9, Q, 20)]),
                                                                      rel=5e-3)
    assert "- sst2: 1 seeded run not composed here" in out and f"- {root / 'seeded'}: its " in out


def test_every_attempt_in_the_ledgers_is_a_release_and_a_resume_continues_its_start(tmp_path, capsys):
    """An attempt abandoned with train.overwrite=true is in no summary, only in its folder's privacy.jsonl: it
    counts, with its own σ and steps; a resumed attempt redraws the steps it redoes (one release: its start's, to
    the most steps); a folder whose summary is lost counts by its ledger; σ is the one accounted per step."""
    root = tmp_path / "runs"
    newer = {"sampling": "poisson", "dataset_size": 1000, "neighbouring": "add_remove"}
    abandoned = [line("t0", 0, 0.8, "start"), line("t0", 10, 0.8), line("t0", 25, 0.8),
                 line("t0", 25, 0.8, "end", status="interrupted")]
    shown = [line("t1", 0, 1.1, "start", **newer), line("t1", 40, 1.1, "end", status="ok", **newer)]
    private_run(root, "a", 1.1, 40, ledger=abandoned + shown)
    resumed = [line("u0", 0, 1.0, "start", sigma_accounted=0.95), line("u0", 30, 1.0, sigma_accounted=0.95),
               line("u1", 20, 1.0, "resume", from_step=20, sigma_accounted=0.95),
               line("u1", 50, 1.0, "end", status="ok", sigma_accounted=0.95)]
    private_run(root, "b", 1.0, 50, lr=1e-2, ledger=resumed, sigma_accounted=0.95)
    private_run(root, "c", 1.2, 15, lr=1e-1, ledger=[line("v0", 0, 1.2, "start"), line("v0", 15, 1.2)])
    (root / "c" / "summary.json").unlink()  # killed mid-write; its config and ledger stay
    main(["report", str(root)])
    out = capsys.readouterr().out
    text, composed = composed_line(out)
    assert composed == pytest.approx(oracle([(0.8, Q, 25), (1.1, Q, 40), (0.95, Q, 50), (1.2, Q, 15)]), rel=5e-3)
    assert "4 private releases on the same training data (3 runs + 1 abandoned attempt)" in text
    assert f"{root / 'c'}: no summary.json; its privacy.jsonl records epsilon 1 spent over 15 steps" in out


def test_an_overwritten_run_still_counts_in_the_report(tmp_path, capsys):
    """Two real runs in one folder, the second with train.overwrite=true: the report composes both, with the σ each
    accounted per step and the steps each ran."""
    tiny = ["method=dp-adam", "train.device=cpu", "model.arch.hidden_size=8", "model.arch.num_hidden_layers=1",
            "model.arch.num_attention_heads=2", "model.arch.intermediate_size=16", "model.arch.patch_size=4"]
    first = run_training(config(*tiny, "train.steps=2"), tmp_path / "run")
    second = run_training(config(*tiny, "train.steps=3", "train.overwrite=true"), tmp_path / "run")
    capsys.readouterr()
    main(["report", str(tmp_path)])
    text = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(f"- {second['data']}:"))
    composed = float(text.split("ε = ")[1].split(" ")[0])
    assert "2 private releases on the same training data (1 run + 1 abandoned attempt)" in text
    want = [(s.get("sigma_accounted", s["sigma"]), s["sample_rate"], s["steps_done"]) for s in (first, second)]
    assert composed == pytest.approx(oracle(want, second["delta"]), rel=5e-3)


def test_analysis_folders_are_listed_apart_neither_results_nor_composed(tmp_path, capsys):
    """A spectrum folder (as dpmem spectrum writes it now, and as an older one did: private, with an ε) and an
    audit's run (AUDIT/run, audit.json beside it) are no results: listed apart, out of the table and of the
    composition of the training runs on their data."""
    root = tmp_path / "runs"
    private_run(root, "a", 1.1, 40)
    private_run(root, "b", 0.9, 20, lr=1e-2)
    private_run(root, "spectrum", 1.1, 40, lr=0.5, analysis="spectrum", private=False, epsilon_spent="inf",
                not_private_because="gradients/ holds un-noised gradients")
    private_run(root, "spectrum-old", 1.1, 40, lr=0.6)
    (root / "spectrum-old" / "spectrum.json").write_text("{}")
    private_run(root / "audit", "run", 1.1, 40, lr=0.7)
    (root / "audit" / "run" / "config.yaml").rename(root / "audit" / "config.yaml")  # where dpmem audit puts it
    (root / "audit" / "audit.json").write_text("{}")
    main(["report", str(root)])
    out = capsys.readouterr().out
    assert set(read_csv(root / "report" / "report.csv")) == {("dp-adam (lr=0.001)", "2", "sst2"),
                                                             ("dp-adam (lr=0.01)", "2", "sst2")}
    text, composed = composed_line(out)
    assert composed == pytest.approx(oracle([(1.1, Q, 40), (0.9, Q, 20)]), rel=5e-3) and "(2 runs)" in text
    assert "Folders of an analysis, not results (3;" in out and "Not in the table" not in out
    assert f"{root / 'spectrum'}: dpmem spectrum (dp-adam on sst2), not private: gradients/ holds un-noised" in out
    assert f"{root / 'spectrum-old'}: dpmem spectrum (dp-adam on sst2), not private: it holds statistics" in out
    assert f"{root / 'audit' / 'run'}: dpmem audit (dp-adam on sst2), ε 1.9 of its own" in out


def test_a_run_is_composed_once_whatever_paths_name_it(tmp_path, capsys):
    """The same folder given twice, or a path inside another (`dpmem report outputs outputs/train`), is one run:
    two runs composed, not four (dp-accounting's PLD of 2·T steps, computed independently)."""
    from tests.test_privacy import direct_epsilon
    root, sigma, q, steps, delta = tmp_path / "outputs", 1.1, 0.05, 40, 1e-5
    for i in range(2):
        summary(root / "train", f"lr{i}", "dp-adam", "sst2", 2.0, i, metric=0.8, sigma=sigma, sample_rate=q,
                steps_done=steps, delta=delta, accountant="pld", neighbouring="add_remove", sampling="poisson",
                epsilon_spent=1.9, n_train=1000)
    want = direct_epsilon("pld", sigma, q, 2 * steps, delta)
    for paths in ([root, root], [root, root / "train"], [root / "train", root / "train" / "lr0"]):
        main(["report", *map(str, paths), "--out", str(tmp_path / "r")])
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("- sst2:"))
        assert "2 private releases" in line and float(line.split("ε = ")[1].split(" ")[0]) == pytest.approx(
            want, rel=5e-3)
        assert read_csv(tmp_path / "r" / "report.csv")[("dp-adam", "2", "sst2")]["n"] == "2"  # two seeds, not four


def test_runs_on_different_files_of_one_data_set_are_not_seeds_of_one_cell(tmp_path, capsys):
    root = tmp_path / "runs"
    for name, path, acc in (("a", "one.csv", 0.5), ("b", "two.csv", 0.55)):
        summary(root, name, "dp-adam", "csv", 2.0, 0, metric=acc)
        (root / name / "config.yaml").write_text(f"data:\n  path: {path}\n")
    main(["report", str(root)])
    rows = read_csv(root / "report" / "report.csv")
    assert {d for _, _, d in rows} == {"csv (one.csv)", "csv (two.csv)"}
    assert [r["n"] for r in rows.values()] == ["1", "1"]


def test_an_analysis_marked_over_a_finished_run_keeps_it_composed(tmp_path, capsys):
    """A training run whose folder an older dpmem let `dpmem memory train.overwrite=true` write into (its summary.json
    kept, the folder marked memory), reported beside another run: both releases composed (the issue's 11.25, not the
    other run alone)."""
    from dpmem.engine.folder import MARK
    root = tmp_path / "runs"
    private_run(root, "a", 1.1, 40)
    private_run(root, "b", 0.9, 20, lr=1e-2, ledger=[line("t1", 20, 0.9, "start", config="b")])
    (root / "b" / MARK).write_text("memory\n")
    (root / "b" / "memory.json").write_text("{}")
    main(["report", str(root)])
    text, composed = composed_line(capsys.readouterr().out)
    assert composed == pytest.approx(oracle([(1.1, Q, 40), (0.9, Q, 20)]), rel=5e-3) and "2 private releases" in text


def test_a_folders_last_verb_hides_none_of_its_private_releases(tmp_path, capsys):
    """`dpmem audit ... train.overwrite=true` into a finished training folder leaves that run's privacy.jsonl under
    an audit's mark: its releases are still composed (two ε-8 runs composed, as before the audit wrote there). The
    reverse: a run trained with train.overwrite=true into an audit's folder is a training run (marked so), listed in
    the table."""
    from dpmem.engine.folder import MARK, owner
    root = tmp_path / "runs"
    private_run(root, "a", 1.1, 40)
    private_run(root, "b", 0.9, 20, lr=1e-2, ledger=[line("t1", 20, 0.9, "start", config="b")])
    (root / "b" / "summary.json").unlink()  # what the audit's overwrite removes; the ledger stays
    (root / "b" / MARK).write_text("audit\n")
    (root / "b" / "audit.json").write_text("{}")
    main(["report", str(root)])
    text, composed = composed_line(capsys.readouterr().out)
    assert composed == pytest.approx(oracle([(1.1, Q, 40), (0.9, Q, 20)]), rel=5e-3) and "2 private releases" in text
    audited = tmp_path / "audited"
    audited.mkdir()
    (audited / MARK).write_text("audit\n")
    (audited / "audit.json").write_text("{}")
    s = run_training(config("train.overwrite=true", "train.steps=2", "privacy.epsilon=8"), audited)
    assert s["status"] == "ok" and owner(audited) == "train"
    main(["report", str(audited)])
    out = capsys.readouterr().out
    assert "Folders of an analysis" not in out and len(read_csv(audited / "report" / "report.csv")) == 1
