"""Each method owns its options: its conf/method file names its class's schema, and an option of another method is
refused with dpmem's one-line error instead of being ignored."""

import dataclasses

import pytest
from omegaconf import OmegaConf

from dpmem.composition import compose_points
from dpmem.config import ConfigError
from dpmem.methods import METHODS

OPTIONS = {name: {f.name for f in dataclasses.fields(cls.config)} for name, cls in METHODS.items()}


def test_each_method_file_names_its_class_schema():
    cfgs = compose_points([[f"method={name}"] for name in METHODS])
    for name, cfg in zip(METHODS, cfgs):
        assert OmegaConf.get_type(cfg.method) is METHODS[name].config, name
        assert set(cfg.method) == OPTIONS[name]


@pytest.mark.parametrize("name", list(METHODS))
def test_an_option_of_another_method_is_refused(name):
    foreign = sorted(set().union(*OPTIONS.values()) - OPTIONS[name])
    assert foreign  # every method lacks some other method's option
    for key in foreign[::max(1, len(foreign) // 3)]:  # a few of them: the rule is the schema's, not per key
        with pytest.raises(ConfigError, match=f"{name} has no option '{key}'; allowed: .*name"):
            compose_points([[f"method={name}", f"method.{key}=1"]])


def test_what_a_method_says_about_itself():
    private = {n for n, c in METHODS.items() if c.spec.private}
    assert private == {"dp-adam", "dp-sgd", "grape", "galore-dp-naive", "dpzero", "dp-sgd-rc"}
    assert {n for n, c in METHODS.items() if c.spec.privatised_gradient} == {"dp-adam", "dp-sgd", "galore-dp-naive",
                                                                        "dp-sgd-rc"}
    assert {n for n, c in METHODS.items() if c.spec.accountant == "rc"} == {"dp-sgd-rc"}
    assert all("max_grad_norm" in OPTIONS[n] for n in private)
    assert not any("max_grad_norm" in OPTIONS[n] for n in set(METHODS) - private)
