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
         "spectrum/retrain-distilroberta-sst2": 15, "spectrum/retrain-minilm-rt": 3}


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
