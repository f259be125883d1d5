"""Every experiment file composes (Hydra compose and dpmem's validation, no training) and its sweep expands to the
grid it says."""

import functools
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from dpmem.composition import CONF_DIR, compose_point

EXPERIMENTS = sorted(p.relative_to(Path(CONF_DIR) / "experiment").with_suffix("").as_posix()
                     for p in (Path(CONF_DIR) / "experiment").rglob("*.yaml"))
GRIDS = {"li/fig1-median": 75, "li/fig1-median-search": 60, "dpsgdrc/search-private": 20,
         "dpsgdrc/search-nonprivate": 20,
         "mini/vit-digits-accuracy": 36, "mini/vit-digits-memory": 16, "mini/steps-grape": 3,
         "mini/steps-dpzero": 3, "minilm-rt": 2, "spectrum/retrain-vit-digits": 9,
         "spectrum/retrain-distilroberta-sst2": 15, "spectrum/retrain-minilm-rt": 3,
         "dpgrape/table7": 36, "dpgrape/table10": 24, "dpgrape/table3": 36,
         "dpgrape/table4": 60, "dpgrape/table5": 60, "dpgrape/fig2-memory": 24, "dpgrape/table8": 4,
         "dpgrape/fig3-memory": 28, "dpgrape/fig4-memory-rank": 7, "dpgrape/table11": 3, "dpgrape/fig6-convergence": 2,
         "dpgrape/fig5-rank": 630, "dpsgdrc/table2": 15, "dpsgdrc/table3": 10, "dpsgdrc/table4": 9,
         "dpgrape/table13": 9, "dpgrape/fig3-memory-opt": 20, "dpgrape/search-table7": 108,
         "dpgrape/search-table10": 72, "dpgrape/search-table3": 36, "dpgrape/search-table45": 80,
         "dpgrape/table3-baselines": 108, "dpsgdrc/fig11-sigma-k": 18, "dpsgdrc/fig12-sigma-d": 24}


@functools.cache
def experiment(name: str) -> DictConfig:
    """The experiment file composed with its Hydra node (its sweep), once per process: read, never changed, by the
    grid and hyperparameter checks (a compose takes a fifth of a second; 42 files are read by three tests)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=[f"experiment={name}"], return_hydra_config=True)


def grid_size(name: str) -> int:
    cfg = experiment(name)
    if "n_trials" in cfg.hydra.sweeper:  # an Optuna search: its trials
        return cfg.hydra.sweeper.n_trials
    params = cfg.hydra.sweeper.params or {}
    return math.prod(len(str(v).split(",")) for v in params.values())


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_validates(name):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        compose_point([f"experiment={name}"])
    assert grid_size(name) == GRIDS.get(name, 1)


def swept_methods(name: str) -> list[str]:
    """The `method` options an experiment file sweeps (read from the file, no composition)."""
    tree = OmegaConf.load(Path(CONF_DIR) / "experiment" / f"{name}.yaml")
    methods = OmegaConf.select(tree, "hydra.sweeper.params.method")
    return str(methods).split(",") if methods is not None else []


@pytest.mark.parametrize("name", [e for e in EXPERIMENTS if swept_methods(e)])
def test_every_swept_method_has_the_options_the_experiment_sets(name):
    """A method option an experiment sets for all its methods must exist in each (dp-adam has no method.rank)."""
    methods = swept_methods(name)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for method in methods:
            chosen = compose_point([f"experiment={name}", f"method={method}"]).method.name
            assert method == chosen or method.startswith(f"{chosen}-")  # dp-adam-materialize is dp-adam


def hp_points(name: str) -> dict[str, list[str]]:
    """The +hp/... group an experiment sweeps, with its listed options."""
    cfg = experiment(name)
    return {k.lstrip("+"): str(v).split(",") for k, v in (cfg.hydra.sweeper.params or {}).items() if "hp/" in k}


@pytest.mark.parametrize("name", [e for e in EXPERIMENTS if e.startswith(("dpgrape/", "dpsgdrc/"))])
def test_every_hyperparameter_point_of_a_table_composes_with_its_method(name):
    """Each conf/hp file a table sweeps exists, composes and validates on top of the experiment, and sets the method
    its name starts with; every file of the group is used."""
    points = hp_points(name)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for group, options in points.items():
            for option in options:
                cfg = compose_point([f"experiment={name}", f"+{group}={option}"])
                assert option.startswith(cfg.method.name) or cfg.method.name == {"hutch": "dp-sgd-rc",
                       "hutchpp": "dp-sgd-rc", "dp-sgd": "dp-adam", "lora": "adam", "dp-lora": "dp-adam"}.get(option), \
                    (name, option)


def test_every_hyperparameter_file_is_swept_by_some_table():
    swept = {f"{g}/{o}" for e in EXPERIMENTS if e.startswith(("dpgrape/", "dpsgdrc/", "li/"))
             for g, opts in hp_points(e).items()
             for o in opts}
    files = {p.relative_to(Path(CONF_DIR)).with_suffix("").as_posix() for p in (Path(CONF_DIR) / "hp").rglob("*.yaml")}
    assert files == swept


def test_table_hyperparameters_are_the_papers():
    """Spot checks against DP-GRAPE review version Tables 6 and 12 (arXiv 2506.15588 Tables 5 and 11) and
    DP-GRAPE Table 3's C search."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        def point(name, option):
            return compose_point([f"experiment=dpgrape/{name}", f"+hp/{option}"])
        grape = point("table7", "table7=grape-mnist")
        adam = point("table7", "table7=dp-adam-cifar100")
        assert (grape.method.max_grad_norm, grape.train.lr, grape.method.rank) == (0.1, 5e-3, 64)
        assert (adam.method.max_grad_norm, adam.train.lr) == (1.0, 5e-4)
        # the ViT tables use delta = 1/n, whichever privacy option the sweep picks; the default is auto
        swept = compose_point(["experiment=dpgrape/table7", "privacy=eps1"])
        assert grape.privacy.delta == swept.privacy.delta == "1/n" and swept.privacy.epsilon == 1
        assert compose_point(["privacy=eps1"]).privacy.delta == "auto"
        mnli = point("table3", "table3=grape-mnli")
        assert (mnli.method.max_grad_norm, mnli.method.rank, mnli.train.steps, mnli.data.k) == (10.0, 16, 1000, 512)
        opt = point("table4", "table45=grape-opt-6.7b-boolq")
        assert (opt.method.max_grad_norm, opt.method.rank, opt.train.steps, opt.data.n_train) == (5.0, 64, 2000, 1000)
        rc = compose_point(["experiment=dpsgdrc/table2", "+hp/dpsgdrc=dp-sgd-rc-billsum-full-eps2"])
        assert (rc.method.max_grad_norm, rc.privacy.epsilon, rc.privacy.delta, rc.method.k) == (0.3665, 2.0, 1e-6, 32)
        assert list(rc.model.trainable) == ["model.layers.1[1-5].*"] and rc.train.batch_size == 256
        lora = compose_point(["experiment=dpsgdrc/table3", "+hp/dpsgdrc=dp-adam-bbc-lora-eps9"])
        assert (lora.model.lora.r, lora.model.lora.alpha, lora.method.clipping.value) == (16, 8.0, "fgc")
        opt = point("table5", "table45=dp-adam-opt-2.7b-drop")
        assert (opt.method.max_grad_norm, opt.train.lr, opt.train.steps, opt.model.name) == (20.0, 1e-5, 3000, "opt-2.7b")
