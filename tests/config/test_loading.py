"""stabmon.config.loading on a schema of its own: the engine knows no stabmon key.

``tests/config/test_config.py`` checks every rule through ``load_config`` and the real
``Config``; these tests build a two-section toy schema and check that the engine
gets everything from the dataclasses' annotations and ``field_meta``: defaults,
the environment variable a field names, the file variable, dotted overrides,
type and range checks on construction, and unknown-key suggestions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from stabmon.config.loading import Section, field_meta, load_sections
from stabmon.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class _Inner(Section):
    depth: int = field(default=2, metadata=field_meta("How deep.", ge=1, le=9))


@dataclass(frozen=True, kw_only=True)
class _Toy(Section):
    name: str = field(default="toy", metadata=field_meta("A name.", env="TOY_NAME", nonempty=True))
    rate: float = field(default=0.5, metadata=field_meta("A rate.", gt=0, lt=1))
    mode: str = field(default="a", metadata=field_meta("A mode.", choices=("a", "b")))
    limit: int | None = field(default=None, metadata=field_meta("A limit.", ge=0))
    weight: float = field(default=1.0, metadata=field_meta("A weight.", ge=0))
    inner: _Inner = field(default_factory=_Inner, metadata=field_meta("A section."))


@dataclass(frozen=True, kw_only=True)
class _Unsupported(Section):
    blob: bytes = field(default=b"", metadata=field_meta("Neither a scalar nor a section."))


def _load(source: Any = None, overrides: Any = None, env: Any = None) -> _Toy:
    return load_sections(_Toy, source, overrides, env, file_variable="TOY_CONFIG")


def test_load_sections_gives_the_dataclass_defaults_without_sources() -> None:
    assert _load(env={}) == _Toy()
    assert _Toy().to_dict() == {
        "name": "toy", "rate": 0.5, "mode": "a", "limit": None, "weight": 1.0,
        "inner": {"depth": 2},
    }  # fmt: skip


def test_load_sections_applies_file_then_environment_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "toy.yaml"
    path.write_text("name: from-file\nrate: 0.25\ninner:\n  depth: 3\n")

    toy = _load(path, {"inner.depth": 4}, {"TOY_NAME": "from-env"})

    assert toy == _Toy(name="from-env", rate=0.25, inner=_Inner(depth=4))


def test_load_sections_reads_the_file_named_by_its_file_variable(tmp_path: Path) -> None:
    path = tmp_path / "toy.yaml"
    path.write_text("mode: b\n")

    assert _load(env={"TOY_CONFIG": str(path)}).mode == "b"
    with pytest.raises(ConfigError, match=r"check environment variable TOY_CONFIG, or unset it"):
        _load(env={"TOY_CONFIG": str(tmp_path / "missing.yaml")})


def test_load_sections_takes_an_instance_as_resolved_and_applies_only_overrides() -> None:
    given = _Toy(name="given")

    toy = _load(given, {"rate": 0.75}, {"TOY_NAME": "ignored"})

    assert toy == _Toy(name="given", rate=0.75)


def test_load_sections_names_the_schema_class_when_the_source_is_of_no_known_kind() -> None:
    with pytest.raises(ConfigError, match=r"a mapping or a _Toy, got 42 \(int\)") as caught:
        _load(42)
    assert caught.value.allowed == "str, os.PathLike[str], Mapping, _Toy or None"


def test_load_sections_suggests_the_close_key_of_a_nested_section() -> None:
    with pytest.raises(ConfigError, match=r"unknown key; did you mean 'inner.depth'\?") as caught:
        _load({"inner": {"dpeth": 3}}, env={})
    assert caught.value.key == "inner.dpeth"
    assert caught.value.allowed == "inner.depth"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rate": 1.0}, r"rate in attach\(\) keyword argument: expected a number > 0 and < 1"),
        ({"inner.depth": 10}, r"inner\.depth .*expected an integer from 1 to 9, got 10"),
        ({"mode": "c"}, r"mode .*expected one of 'a', 'b', got 'c'"),
        ({"limit": "5"}, r"limit .*expected an integer or None, got '5' \(str\); write it without"),
        ({"name": ""}, r"name .*expected a non-empty string, got ''"),
        ({"rate.x": 1}, r"rate\.x .*unknown key; rate is a single value, not a section"),
    ],
)
def test_load_sections_checks_each_value_against_its_field_meta(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(overrides=overrides, env={})


def test_section_checks_values_on_direct_construction_and_widens_ints_for_floats() -> None:
    with pytest.raises(ConfigError, match=r"depth in _Inner\(\): expected an integer from 1 to 9"):
        _Inner(depth=0)
    with pytest.raises(ConfigError, match=r"inner in _Toy\(\): expected a _Inner, got"):
        _Toy(inner={"depth": 3})  # a mapping is not a section

    built, loaded = _Toy(weight=2), _load(overrides={"weight": 3}, env={})
    assert (built.weight, loaded.weight) == (2.0, 3.0)
    assert type(built.weight) is float and type(loaded.weight) is float


def test_section_rejects_an_annotation_the_checker_cannot_read() -> None:
    with pytest.raises(TypeError, match=r"_Unsupported\.blob: unsupported annotation"):
        _Unsupported()
