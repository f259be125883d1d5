"""What a new user's trial found taken without a word, or ending in a traceback (issue 73): each is now one line
naming the key (exit 2), for every verb where the verb reads it. In-process and cheap: each case is refused before
anything trains."""

import json

import pytest
from omegaconf import OmegaConf

from dpmem.composition import compose_points
from dpmem.config import ConfigError
from dpmem.data import build_data
from dpmem.data.users import for_training
from dpmem.privacy.accounting import calibrate_sigma, epsilon_spent

TINY = ["train.steps=2", "train.batch_size=32", "logging.progress=false", "train.device=cpu",
        "logging.memory_steps=0"]
USERS = ["data.users=300", "privacy.unit=user", "privacy.records_per_user=4"]


def config(*overrides):
    """A run's config as every verb composes and validates it (dpmem.composition)."""
    return compose_points([list(overrides)])[0]


def one_line(r, key: str, *words: str) -> str:
    """The command was refused in one line naming `key` and saying each of `words`."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"dpmem: error: {key}: ") and all(w in lines[0] for w in words), lines[0]
    return lines[0]


# -- item 7: a key added with + that no schema reads ----------------------------------------------------------------
@pytest.mark.parametrize("verb, added", [
    ("train", "+method.max_grad_nrom=0.1"), ("train", "+privacy.epsilonn=1"), ("train", "+train.stepz=5"),
    ("train", "+logging.wandb.projekt=x"), ("train", "+nothing=1"), ("train", "++privacy.epsilonn=1"),
    ("memory", "+memory.budgett=24GB"), ("memory", "+model.lora.rr=4"), ("plan", "+plan.devise=l4"),
    ("audit", "+audit.canary=10"), ("spectrum", "+spectrum.topp=3"), ("train", "+data.columns.usr=a"),
])
def test_a_key_added_that_no_schema_reads_is_refused_as_a_misspelt_one_is(cli, tmp_path, verb, added):
    key = added.lstrip("+").split("=")[0]
    line = one_line(cli(verb, "method=grape", added, *TINY), key, "; allowed: ")
    misspelt = cli(verb, "method=grape", added.lstrip("+"), *TINY)  # the same key without +: Hydra's refusal
    assert one_line(misspelt, key, "; allowed: ").split("; allowed: ")[1] == line.split("; allowed: ")[1]
    assert not list(tmp_path.iterdir())


def test_a_key_added_to_a_free_form_section_is_still_taken():
    assert config("+model.arch.layer_norm_eps=1e-6").model.arch.layer_norm_eps == 1e-6  # transformers reads it


# -- item 5: user ids that are blank or not a value -------------------------------------------------------------------
def _jsonl(tmp_path, authors) -> str:
    path = tmp_path / "mail.jsonl"
    path.write_text("".join(json.dumps({"text": f"mail {i}", "label": i % 2, "sender": a}) + "\n"
                            for i, a in enumerate(authors)))
    return str(path)


@pytest.mark.parametrize("blank", ["", "   ", None])
def test_a_blank_user_id_is_refused_naming_the_user_column(tmp_path, blank):
    path = _jsonl(tmp_path, ["ann", "bob", blank, "cy"] * 10)
    cfg = config("data=jsonl", f"data.path={path}", "data.columns.user=sender", "model=roberta-tiny",
                 "privacy.unit=user", "privacy.records_per_user=2")
    with pytest.raises(ConfigError, match=r"empty cells in \{'sender': 10\}.*user \(column 'sender'\)"):
        build_data(cfg.data, cfg.model)


def test_a_list_as_a_user_id_is_refused(tmp_path):
    path = _jsonl(tmp_path, ["ann", ["bob", "cy"]] * 10)
    cfg = config("data=jsonl", f"data.path={path}", "data.columns.user=sender", "model=roberta-tiny",
                 "privacy.unit=user", "privacy.records_per_user=2")
    with pytest.raises(ConfigError, match="holds a list") as e:
        build_data(cfg.data, cfg.model)
    assert e.value.key == "data.columns.user"


def test_a_data_file_that_is_not_there_says_so(tmp_path):
    cfg = config("data=csv", "data.path=reviews.csv", "model=roberta-tiny")
    with pytest.raises(ConfigError, match="'reviews.csv' does not exist") as e:
        build_data(cfg.data, cfg.model)
    assert e.value.key == "data.path"


# -- item 3: tracebacks ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sigma", ["1e-9", "0.01"])
def test_a_noise_multiplier_below_the_least_accounted_is_one_line(cli, tmp_path, sigma):
    from dpmem.privacy.accounting import MIN_SIGMA
    one_line(cli("train", f"privacy.noise_multiplier={sigma}", *TINY), "privacy.noise_multiplier", f"{MIN_SIGMA:g}")
    assert config(f"privacy.noise_multiplier={MIN_SIGMA}").privacy.noise_multiplier == MIN_SIGMA  # the least, taken
    assert not list(tmp_path.iterdir())


def test_more_records_per_user_than_any_user_has_is_refused_before_anything_is_laid_out(cli, tmp_path):
    cfg = config(*USERS[:2], "privacy.records_per_user=1000000000")
    data = build_data(cfg.data, cfg.model)
    most = int(data.users.unique(return_counts=True)[1].max())
    with pytest.raises(ConfigError, match=f"allowed: 1..{most}"):
        for_training(cfg.privacy, data, cfg.data.split_seed)
    assert for_training(OmegaConf.merge(cfg.privacy, {"records_per_user": most}), data, 0)[1]["records_over_bound"] == 0
    one_line(cli("train", *USERS[:2], "privacy.records_per_user=1000000000", *TINY, "hydra.run.dir=run"),
             "privacy.records_per_user", f"1..{most}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("k", [0, -3, 2.5, True])
def test_user_records_that_is_not_a_positive_integer_is_refused_by_name(k):
    for fn in (epsilon_spent, calibrate_sigma):
        with pytest.raises(ValueError, match="user_records"):
            fn(1.0, 1e-5, 0.01, 10, user_records=k)


# -- item 4: taken without a word ------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, key", [
    (["privacy.noise=bandmf", "privacy.bands=4"], "privacy.noise"),
    (["privacy.noise_multiplier=1"], "privacy.noise_multiplier"),
])
def test_privacy_none_with_a_private_runs_key_is_refused(cli, extra, key):
    one_line(cli("train", "method=dp-adam", "privacy=none", *extra, *TINY), key, "privacy=none")
    assert config("method=dp-adam", *extra).privacy[key.split(".")[1]] is not None  # without privacy=none: taken


@pytest.mark.parametrize("given, key", [("data.users=300", "data.users"),
                                        ("data.columns.user=sender", "data.columns.user")])
def test_users_under_a_record_level_unit_are_refused(cli, given, key):
    one_line(cli("train", given, *TINY), key, "privacy.unit=user")


@pytest.mark.parametrize("terms", [{"noise": ("bandmf", 4, 100)}, {"noise": "bandmf"}, {"groups": 4},
                                   {"noise": "bandmf", "groups": 4, "sampling": "cyclic", "dataset_size": 1000}])
def test_the_apis_accounting_refuses_correlated_terms_it_would_ignore_or_misread(terms):
    from dpmem import api
    for fn in (api.epsilon_spent, api.calibrate_sigma):
        with pytest.raises(ValueError, match="noise|groups"):
            fn(1.0, 1e-5, 0.01, 10, **terms)


def test_the_plan_of_a_uls_run_refuses_more_users_a_step_than_there_are():
    from dpmem import api
    cfg = api.config("data.users=100", "privacy.unit=user", "privacy.records_per_user=2", "train.batch_size=128",
                     "model.arch.hidden_size=16", "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2",
                     "model.arch.intermediate_size=16")
    users = int(build_data(cfg.data, cfg.model).users.unique().numel())
    with pytest.raises(ConfigError, match=f"128 users a step .* of {users}") as e:
        api.plan(cfg)
    assert e.value.key == "train.batch_size"


# -- item 5: unclear ---------------------------------------------------------------------------------------------------
def test_train_help_of_a_group_shows_its_keys_presets_and_where_they_are_explained(cli, tmp_path):
    r = cli("train", "privacy.delta=1e-6", "--help", "privacy")
    assert r.returncode == 0, r.stderr
    assert "docs/configuration.md#privacy" in r.stdout and "Presets (privacy=NAME): default, eps1" in r.stdout
    shown = r.stdout.split("\n\n", 1)[1]
    assert OmegaConf.create(shown) == OmegaConf.create(OmegaConf.to_yaml(config("privacy.delta=1e-6").privacy,
                                                                         resolve=True))
    one_line(cli("train", "--help", "privcy"), "privcy", "dpmem train --help privacy")
    assert not list(tmp_path.iterdir())


def test_els_calibration_says_what_it_does_before_it_starts(monkeypatch, capsys):
    import torch

    from dataclasses import replace

    from dpmem.methods import method_class
    from dpmem.privacy import calibrate
    from dpmem.privacy.accounting import Event
    said = []
    monkeypatch.setattr(Event, "calibrated", lambda self, *a, **k: said.append(capsys.readouterr().err)
                        or replace(self, sigma=1.0))
    cfg = config(*USERS, "privacy.user_sampling=records", "method=dp-adam")
    calibrate.calibrate(cfg, method_class("dp-adam").spec, 1000, 2, "poisson", torch.device("cpu"), users=200)
    assert len(said) == 1 and said[0].count("\n") == 1 and "calibrating σ to ε = 8 per user (ELS" in said[0]
