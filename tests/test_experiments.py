"""Every experiment file composes (Hydra compose and dpmem's validation, no training) and its sweep expands to the
grid it says."""

import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dpmem.cli import CONF_DIR, compose_point

EXPERIMENTS = sorted(p.relative_to(Path(CONF_DIR) / "experiment").with_suffix("").as_posix()
                     for p in (Path(CONF_DIR) / "experiment").rglob("*.yaml"))
GRIDS = {"mini/vit-digits-accuracy": 36, "mini/vit-digits-memory": 16, "mini/steps-grape": 3,
         "mini/steps-dpzero": 3, "minilm-rt": 2, "spectrum/retrain-vit-digits": 9,
         "spectrum/retrain-distilroberta-sst2": 15, "spectrum/retrain-minilm-rt": 3,
         "dpgrape/table7": 36, "dpgrape/table10": 24, "dpgrape/table3": 36}


def grid_size(name: str) -> int:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=[f"experiment={name}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params or {}
    return math.prod(len(str(v).split(",")) for v in params.values())


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_validates(name):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        compose_point([f"experiment={name}"])
    assert grid_size(name) == GRIDS.get(name, 1)


@pytest.mark.parametrize("table", ["table3", "table7", "table10"])
def test_every_point_of_a_table_composes_with_its_method_data_and_hyperparameters(table):
    """Each conf/hp/TABLE file sets its method and data set (and the paper's C and lr) on top of the experiment."""
    files = sorted((Path(CONF_DIR) / "hp" / table).glob("*.yaml"))
    assert len(files) == {"table3": 6, "table7": 9, "table10": 6}[table]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for f in files:
            cfg = compose_point([f"experiment=dpgrape/{table}", f"+hp/{table}={f.stem}", "privacy=eps2"])
            assert f.stem == f"{cfg.method.name}-{cfg.data.name}" and cfg.privacy.epsilon == 2.0
            assert (cfg.method.rank, cfg.train.batch_size) == ((16, 64) if table == "table3" else (64, 1000))
        # spot checks against [R] Table 6: grape on MNIST C = 0.1, lr 5e-3; DP-Adam on CIFAR-100 C = 1, lr 5e-4
        if table == "table7":
            grape = compose_point(["experiment=dpgrape/table7", "+hp/table7=grape-mnist"])
            adam = compose_point(["experiment=dpgrape/table7", "+hp/table7=dp-adam-cifar100"])
            assert (grape.method.max_grad_norm, grape.train.lr) == (0.1, 5e-3)
            assert (adam.method.max_grad_norm, adam.train.lr) == (1.0, 5e-4)
