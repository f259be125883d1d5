"""dpmem.composition keeps each config file's parse for the process (Hydra parses every file anew per compose): an
edited file is read again at once, and no composition shares its nodes with another's."""

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import dpmem.composition  # noqa: F401 (installs the kept parses)
from dpmem.composition import compose_points


def test_a_config_file_edited_between_two_compositions_is_read_again(tmp_path):
    (tmp_path / "group").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - group: one\n  - _self_\nvalue: 1\n")
    (tmp_path / "group" / "one.yaml").write_text("size: 1\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        assert OmegaConf.to_container(compose("config")) == {"group": {"size": 1}, "value": 1}
        # the same length, and quicker than a file system's time stamps tell apart
        (tmp_path / "config.yaml").write_text("defaults:\n  - group: one\n  - _self_\nvalue: 2\n")
        (tmp_path / "group" / "one.yaml").write_text("size: 3\n")
        assert OmegaConf.to_container(compose("config")) == {"group": {"size": 3}, "value": 2}


def test_a_composed_config_edited_leaves_the_next_composition_as_the_files_say():
    first, = compose_points([["method=dp-adam"]])
    first.method.max_grad_norm = 123.0
    first.train.steps = 7
    second, = compose_points([["method=dp-adam"]])
    assert second.method.max_grad_norm != 123.0 and second.train.steps != 7
