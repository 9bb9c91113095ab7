"""The generated dashboards against Grafana's own schema, through the Grafana Foundation SDK.

No Grafana server can be installed here. The Grafana Foundation SDK (``grafana-foundation-sdk``
on PyPI, the build for Grafana 11.3, the compose image's minor release) is generated from the
same schema as ``@grafana/schema``: each generated dashboard's JSON is loaded into its typed
``Dashboard`` model (panel options and field config into each panel plugin's own types,
targets into the Prometheus data source's query type), and then:

- every field the JSON holds is one the schema has (written back, nothing is lost), but for
  the Prometheus data source's own annotation fields, listed below with the reason;
- every value has the type the SDK declares for its field (enums, literals, numbers, lists);
- every panel type is a panel plugin Grafana ships, every unit one Grafana knows, every query
  a Prometheus query on the ``$datasource`` variable.

The SDK needs Python 3.11 or later (the Makefile's venv is 3.11; pyproject pins it there only).
"""

from __future__ import annotations

import enum
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

if sys.version_info < (3, 11):
    pytest.skip("Requires: Python 3.11 (grafana-foundation-sdk)", allow_module_level=True)

from grafana_foundation_sdk.cog import plugins, runtime
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as schema
from grafana_foundation_sdk.models import prometheus, timeseries, units

JSON_DIR = Path(__file__).resolve().parents[2] / "dashboards" / "json"
DASHBOARDS = sorted(JSON_DIR.glob("*.json"))
SDK_PACKAGE = "grafana_foundation_sdk"
#: The Prometheus data source's annotation fields: its annotation support reads the tags, the
#: title and text templates, the step and the time-from-value switch off the annotation query
#: itself, whose schema (AnnotationQuery) leaves a data source's own fields open.
PROMETHEUS_ANNOTATION_FIELDS = {"step", "tagKeys", "textFormat", "titleFormat", "useValueForTime"}
#: Units Grafana knows: the SDK's list of them, and Grafana's custom units (a prefix naming
#: the kind, then the text: "suffix:steps/s").
UNITS = {value for value in vars(units).values() if isinstance(value, str)}
CUSTOM_UNIT = re.compile(r"(?:prefix|suffix|si|count|currency|time|bool):.+")

plugins.register_default_plugins()


def _source(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _load(path: Path) -> schema.Dashboard:
    return schema.Dashboard.from_json(_source(path))


def _panels(dashboard: schema.Dashboard) -> list[Any]:
    found = []
    for panel in dashboard.panels or []:
        found.append(panel)
        found.extend(getattr(panel, "panels", None) or [])
    return found


def _dropped(source: Any, written: Any, path: str = "") -> list[str]:
    """Fields of ``source`` that ``written`` (the typed model written back) lost or changed."""
    if isinstance(source, dict):
        if not isinstance(written, dict):
            return [f"{path}: {type(written).__name__} instead of an object"]
        lost = []
        for key, value in source.items():
            if key not in written:
                lost.append(f"{path}/{key}")
            else:
                lost.extend(_dropped(value, written[key], f"{path}/{key}"))
        return lost
    if isinstance(source, list):
        if not isinstance(written, list) or len(written) != len(source):
            return [f"{path}: list changed"]
        return [
            e for i, item in enumerate(source) for e in _dropped(item, written[i], f"{path}[{i}]")
        ]
    return [] if source == written else [f"{path}: {source!r} became {written!r}"]


def _type_errors(value: Any, hint: Any, path: str) -> list[str]:
    """Where ``value`` is not of the type ``hint`` (the SDK's annotation) says."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return [] if not _is_model(value) else _model_errors(value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return [] if type(None) in args else [f"{path}: null where {hint} is wanted"]
        args = tuple(arg for arg in args if arg is not type(None))
        # The member of the same shape judges the value (a list by list[...], a model by its
        # class), so its errors, not another member's "is not a list", are the ones reported.
        shaped = [
            arg
            for arg in args
            if typing.get_origin(arg) is type(value)
            or (isinstance(arg, type) and _is_model(value) and isinstance(value, arg))
        ]
        if len(shaped) == 1:
            return _type_errors(value, shaped[0], path)
        attempts = [_type_errors(value, arg, path) for arg in args]
        return [] if any(not a for a in attempts) else min(attempts, key=len)
    if hint is type(None):
        return [] if value is None else [f"{path}: {value!r} is not null"]
    if origin is typing.Literal:
        return [] if value in args else [f"{path}: {value!r} not one of {args}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: {type(value).__name__} is not a list"]
        return [
            e for i, item in enumerate(value) for e in _type_errors(item, args[0], f"{path}[{i}]")
        ]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: {type(value).__name__} is not an object"]
        return [e for k, v in value.items() for e in _type_errors(v, args[1], f"{path}/{k}")]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = {member.value for member in hint}
        ok = isinstance(value, hint) or value in allowed
        return [] if ok else [f"{path}: {value!r} is not a {hint.__name__} ({sorted(allowed)})"]
    if hint is bool:
        return [] if isinstance(value, bool) else [f"{path}: {value!r} is not a boolean"]
    if hint in (int, float):
        number = isinstance(value, int if hint is int else (int, float))
        ok = number and not isinstance(value, bool)
        return [] if ok else [f"{path}: {value!r} is not a {hint.__name__}"]
    if hint is str:
        return [] if isinstance(value, str) else [f"{path}: {value!r} is not a string"]
    if isinstance(hint, type):
        if not isinstance(value, hint):
            return [f"{path}: {type(value).__name__} is not a {hint.__name__}"]
        return _model_errors(value, path) if _is_model(value) else []
    raise AssertionError(f"{path}: no check for the SDK's type {hint!r}")


def _is_model(value: Any) -> bool:
    return type(value).__module__.startswith(SDK_PACKAGE) and not isinstance(value, enum.Enum)


def _model_errors(model: Any, path: str) -> list[str]:
    hints = typing.get_type_hints(type(model))
    return [
        e
        for name, hint in hints.items()
        for e in _type_errors(getattr(model, name), hint, f"{path}.{name}")
    ]


@pytest.fixture(params=DASHBOARDS, ids=lambda p: p.stem)
def path(request: pytest.FixtureRequest) -> Path:
    found: Path = request.param
    return found


def test_there_are_dashboards_to_check() -> None:
    assert [p.stem for p in DASHBOARDS] == ["stabmon-gpu-nodes", "stabmon-training"]


def test_every_field_of_the_dashboard_is_one_grafanas_schema_has(path: Path) -> None:
    source = _source(path)
    written = json.loads(json.dumps(_load(path), cls=JSONEncoder))
    lost = _dropped(source, written)
    annotation = [
        f"/annotations/list[{i}]/{field}"
        for i in range(9)
        for field in PROMETHEUS_ANNOTATION_FIELDS
    ]
    assert [field for field in lost if field not in annotation] == []


def test_every_value_has_the_type_grafanas_schema_gives_its_field(path: Path) -> None:
    assert _model_errors(_load(path), path.stem) == []


def test_every_panel_is_a_panel_plugin_grafana_ships_with_its_typed_options(path: Path) -> None:
    for panel in _panels(_load(path)):
        if isinstance(panel, schema.RowPanel):
            continue
        config = runtime.panelcfg_config(panel.type_val)
        assert config is not None, f"{panel.title}: panel type {panel.type_val!r}"
        # Options and field config decoded into the plugin's own types, not left as dicts.
        assert _is_model(panel.options), f"{panel.title}: options not {panel.type_val}'s"
        assert type(panel.options).__module__.endswith(f".{panel.type_val}")
        if panel.type_val == "timeseries":
            assert isinstance(panel.field_config.defaults.custom, timeseries.FieldConfig)


def test_every_unit_is_one_grafana_knows(path: Path) -> None:
    used = set()
    for panel in _panels(_load(path)):
        if isinstance(panel, schema.Panel) and panel.field_config:
            used.add(panel.field_config.defaults.unit)
            for override in panel.field_config.overrides or []:
                used.update(p.value for p in override.properties if p.id_val == "unit")
    used.discard(None)
    unknown = {unit for unit in used if unit not in UNITS and not CUSTOM_UNIT.fullmatch(unit)}
    assert used and not unknown, unknown


def test_every_query_is_a_prometheus_query_on_the_datasource_variable(path: Path) -> None:
    dashboard = _load(path)
    variable = {v.name: v for v in dashboard.templating.list_val}["datasource"]
    assert variable.type_val == schema.VariableType.DATASOURCE and variable.query == "prometheus"
    on_variable = schema.DataSourceRef(type_val="prometheus", uid="${datasource}")
    queries = 0
    for panel in _panels(dashboard):
        if isinstance(panel, schema.RowPanel):
            continue
        assert panel.datasource.to_json() == on_variable.to_json(), panel.title
        for target in panel.targets or []:
            assert isinstance(target, prometheus.Dataquery), (panel.title, type(target))
            assert not isinstance(target, runtime.UnknownDataquery)
            assert isinstance(target, cogvariants.Dataquery) and target.expr
            queries += 1
    for annotation in dashboard.annotations.list_val or []:
        assert annotation.datasource.to_json() == on_variable.to_json()
    assert queries > 0


def test_the_checks_catch_what_grafana_would_not_take(tmp_path: Path) -> None:
    # The checks above are only worth their passing if they fail on a broken dashboard.
    source = _source(DASHBOARDS[0])
    panel = next(p for p in source["panels"] if p["type"] != "row")
    panel["fieldConfig"]["defaults"]["unit"] = "furlongs"
    panel["repeatDirection"] = "diagonal"
    panel["gridPos"]["w"] = "wide"
    panel["colour"] = "red"
    series = next(p for p in source["panels"] if p["type"] == "timeseries")
    series["fieldConfig"]["defaults"]["custom"]["drawStyle"] = "wiggly"
    broken = schema.Dashboard.from_json(source)
    errors = _model_errors(broken, "broken")
    assert any("repeat_direction" in e and "diagonal" in e for e in errors), errors
    assert any("grid_pos.w" in e for e in errors), errors
    assert any(
        e.endswith("draw_style: 'wiggly' is not a GraphDrawStyle (['bars', 'line', 'points'])")
        for e in errors
    )
    written = json.loads(json.dumps(broken, cls=JSONEncoder))
    assert any(e.endswith("/colour") for e in _dropped(source, written))
    assert "furlongs" not in UNITS and not CUSTOM_UNIT.fullmatch("furlongs")
