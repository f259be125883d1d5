"""docs/configuration.md, the configuration reference, is what scripts/config_reference.py writes from the schema
(dpmem/config.py) now, and names every key of every group with its enum options, walked here from the dataclasses
themselves rather than through the generator's reading of the source."""

import dataclasses
import importlib.util
import re
import sys
import typing
from enum import Enum
from pathlib import Path

import pytest

from dpmem import config as schema

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"


def generator():
    """scripts/config_reference.py, imported once (its dataclasses need it in sys.modules)."""
    if "config_reference" not in sys.modules:
        spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["config_reference"] = module
        spec.loader.exec_module(module)
    return sys.modules["config_reference"]


def keys(cls: type, prefix: str):
    """(dotted key, its type) of every field of `cls`, nested dataclasses walked into (their own key included)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}.{f.name}" if prefix else f.name, hints[f.name]
        yield key, tp
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            yield from keys(inner[0], key)


def enum_options(tp) -> list[str]:
    """The values of the enum a key takes (also as list items or Optional)."""
    for arg in (tp, *typing.get_args(tp)):
        if isinstance(arg, type) and issubclass(arg, Enum):
            return [m.value for m in arg]
        if typing.get_args(arg) and arg is not tp and (found := enum_options(arg)):
            return found
    return []


def rows(text: str, key: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"| `{key}` |")]


def section(page: str, anchor: str) -> str:
    """The page from the heading with {#anchor} to the next heading of any level."""
    start = page.index(f"{{#{anchor}}}")
    following = re.search(r"^#{1,6} ", page[start:], re.MULTILINE)
    return page[start:start + following.start()] if following else page[start:]


def groups() -> dict[str, list]:
    """Each section of the page and the schemas whose keys it holds: a group per field of Config, one section per
    method schema; Config's own plain keys at the top level."""
    hints = typing.get_type_hints(schema.Config)
    out = {}
    for f in dataclasses.fields(schema.Config):
        tp = hints[f.name]
        if tp is schema.MethodConfig:
            for name, cls in schema.METHOD_SCHEMAS.items():
                out[f"method-{name}"] = ("method", cls)
        elif dataclasses.is_dataclass(tp):
            out[f.name] = (f.name, tp)
    return out


def test_the_page_is_what_the_generator_writes_now():
    page = PAGE.read_text()
    assert page == generator().render(), "docs/configuration.md is stale: run python scripts/config_reference.py"


def test_every_key_and_every_enum_option_of_the_schema_is_on_the_page():
    page = PAGE.read_text()
    walked = 0
    for anchor, (prefix, cls) in groups().items():
        text = section(page, anchor)
        for key, tp in keys(cls, prefix):
            found = rows(text, key)
            assert len(found) == 1, f"{key}: {len(found)} rows in the section #{anchor}"
            for option in enum_options(tp):
                assert f"`{option}`" in found[0], f"{key}: option {option} not in its row"
            walked += 1
    hints = typing.get_type_hints(schema.Config)
    for f in dataclasses.fields(schema.Config):
        if not dataclasses.is_dataclass(hints[f.name]) and hints[f.name] is not schema.MethodConfig:
            assert len(rows(section(page, "top-level"), f.name)) == 1, f.name
    assert walked > 150  # every group's keys, each method schema's


@pytest.mark.parametrize("group, cls", [("train", schema.TrainConfig), ("privacy", schema.PrivacyConfig)])
def test_the_page_names_every_key_of_train_and_privacy(group, cls):
    page = PAGE.read_text()
    for f in dataclasses.fields(cls):
        assert f"`{group}.{f.name}`" in page, f"{group}.{f.name}"


def test_a_key_without_a_comment_fails_the_generator_naming_it(tmp_path, monkeypatch):
    gen = generator()
    source = gen.SOURCE.read_text()
    stripped = re.sub(r"^(    lr: float = [^#\n]*?)\s*#.*$", r"\1", source, count=1, flags=re.MULTILINE)
    assert stripped != source
    copy = tmp_path / "config.py"
    copy.write_text(stripped)
    monkeypatch.setattr(gen, "SOURCE", copy)
    with pytest.raises(gen.MissingComment, match=r"train\.lr: no comment"):
        gen.render()
