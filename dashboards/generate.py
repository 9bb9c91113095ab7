"""Write ``dashboards/json/<uid>.json`` for every ``dashboards/*.dashboard.py``.

    python dashboards/generate.py            # regenerate the committed JSON
    python dashboards/generate.py --check    # exit 1 if the committed JSON is stale

Each ``*.dashboard.py`` defines ``dashboard`` (grafanalib's convention, as its
``generate-dashboard`` tool reads it). The JSON is what Grafana provisions
(``deploy/grafana/provisioning``), so it is committed, and ``--check`` keeps it
in step with the Python that defines it. ``expressions()`` lists every PromQL
expression of a generated dashboard for the tests that run them.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from grafanalib._gen import DashboardEncoder

from stabmon.shared.generated import check_fresh, stale_files

DASHBOARDS_DIR = Path(__file__).resolve().parent
JSON_DIR = DASHBOARDS_DIR / "json"
PATTERN = "*.dashboard.py"


class DashboardDefinitionError(Exception):
    """A ``*.dashboard.py`` file that does not define a usable ``dashboard``."""


def load(path: Path) -> Any:
    """The ``dashboard`` a ``*.dashboard.py`` file defines, with panel ids assigned."""
    # The dashboard files import their helpers as `panels`, a sibling module.
    added = str(path.parent) not in sys.path
    if added:
        sys.path.insert(0, str(path.parent))
    try:
        namespace = runpy.run_path(str(path))
    finally:
        if added:
            sys.path.remove(str(path.parent))
    dashboard = namespace.get("dashboard")
    if dashboard is None or not hasattr(dashboard, "auto_panel_ids"):
        raise DashboardDefinitionError(
            f"{path.name}: expected a grafanalib Dashboard named 'dashboard', "
            f"got {type(dashboard).__name__}"
        )
    if not dashboard.uid:
        raise DashboardDefinitionError(f"{path.name}: the dashboard needs a stable uid")
    return dashboard.auto_panel_ids()


#: What grafanalib writes that Grafana's dashboard schema has no field for, left out of the
#: committed JSON so that it is the schema's own shape (tests/dashboards/test_grafana_schema.py
#: loads it into the Grafana Foundation SDK's typed model). Grafana ignores all of these on
#: load: layout from before panels had gridPos (rows, hideControls), the dark/light style now
#: a user preference, sharedCrosshair (graphTooltip says it), empty export inputs, and the
#: graph-era panel keys.
LEGACY_DASHBOARD_KEYS = frozenset({"__inputs", "rows", "hideControls", "sharedCrosshair", "style"})
LEGACY_PANEL_KEYS = frozenset({"editable", "error"})
#: A Prometheus target's query is ``expr``; these are grafanalib's fields for other sources
#: (Graphite's ``target``, OpenTSDB's ``metric``, the pre-7 ``step``, a generic ``query``).
LEGACY_TARGET_KEYS = frozenset({"metric", "query", "step", "target"})
#: Template variable tags, removed in Grafana 8.
LEGACY_VARIABLE_KEYS = frozenset({"tags", "useTags", "tagsQuery", "tagValuesQuery"})
#: The fields of Grafana's RowPanel: grafanalib gives rows every panel field (targets, links).
ROW_KEYS = frozenset(
    {"type", "collapsed", "title", "datasource", "gridPos", "id", "panels", "repeat"}
)


def schema_shaped(data: dict[str, Any]) -> dict[str, Any]:
    """grafanalib's dashboard JSON without what Grafana's schema has no field for: the legacy
    keys above, and unset values written as null (a null where the schema wants an object,
    such as a row's datasource, is not one; a threshold step's null value is: the base)."""

    def clean(value: Any, parent: str = "") -> Any:
        if isinstance(value, dict):
            return {
                k: clean(v, k)
                for k, v in value.items()
                if v is not None or (parent == "steps" and k == "value")
            }
        if isinstance(value, list):
            return [clean(item, parent) for item in value]
        return value

    def panel(item: dict[str, Any]) -> dict[str, Any]:
        if item.get("type") == "row":
            kept = {k: v for k, v in item.items() if k in ROW_KEYS}
            kept["panels"] = [panel(p) for p in item.get("panels", [])]
            return kept
        kept = {k: v for k, v in item.items() if k not in LEGACY_PANEL_KEYS}
        if "targets" in kept:
            kept["targets"] = [
                {k: v for k, v in t.items() if k not in LEGACY_TARGET_KEYS} for t in kept["targets"]
            ]
        return kept

    shaped: dict[str, Any] = clean(
        {k: v for k, v in data.items() if k not in LEGACY_DASHBOARD_KEYS}
    )
    shaped["panels"] = [panel(p) for p in shaped.get("panels", [])]
    templating = shaped.get("templating", {})
    variables = []
    for variable in templating.get("list", []):
        kept = {k: v for k, v in variable.items() if k not in LEGACY_VARIABLE_KEYS}
        current = {k: v for k, v in kept.pop("current", {}).items() if k != "tags"}
        if "value" in current:  # an option needs its text and value; none: Grafana picks one
            kept["current"] = current
        variables.append(kept)
    templating["list"] = variables
    return shaped


def render(dashboard: Any) -> str:
    """The dashboard as committed: schema-shaped, sorted keys, two-space indent, a newline."""
    data = json.loads(json.dumps(dashboard.to_json_data(), cls=DashboardEncoder))
    return json.dumps(schema_shaped(data), sort_keys=True, indent=2) + "\n"


def render_all(source_dir: Path = DASHBOARDS_DIR) -> dict[str, str]:
    """``{"<uid>.json": text}`` for every dashboard file in ``source_dir``."""
    rendered: dict[str, str] = {}
    sources: dict[str, str] = {}
    for path in sorted(source_dir.glob(PATTERN)):
        dashboard = load(path)
        name = f"{dashboard.uid}.json"
        if name in rendered:
            raise DashboardDefinitionError(
                f"{path.name}: uid {dashboard.uid!r} is already used by {sources[name]}"
            )
        rendered[name] = render(dashboard)
        sources[name] = path.name
    return rendered


def stale(rendered: dict[str, str], json_dir: Path = JSON_DIR) -> list[str]:
    """Files in ``json_dir`` that differ from ``rendered``, are missing, or have no source."""
    return stale_files(rendered, json_dir, owned_glob="*.json")


def write(rendered: dict[str, str], json_dir: Path = JSON_DIR) -> list[str]:
    """Bring ``json_dir`` in step with ``rendered``; returns the names it changed."""
    changed = stale(rendered, json_dir)
    json_dir.mkdir(parents=True, exist_ok=True)
    for name in changed:
        target = json_dir / name
        if name in rendered:
            target.write_text(rendered[name], encoding="utf-8")
        else:
            target.unlink()  # its dashboard file is gone or its uid changed
    return changed


def expressions(dashboard_json: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a generated dashboard: panel targets, then annotations."""
    found = [
        target["expr"]
        for panel in _panels(dashboard_json.get("panels", []))
        for target in panel.get("targets", [])
        if target.get("expr")
    ]
    annotations = dashboard_json.get("annotations", {}).get("list", [])
    found.extend(a["expr"] for a in annotations if a.get("expr"))
    return found


def _panels(panels: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the JSON is stale; write nothing"
    )
    parser.add_argument("--json-dir", type=Path, default=JSON_DIR, help="default: %(default)s")
    args = parser.parse_args(argv)
    try:
        rendered = render_all()
    except DashboardDefinitionError as error:
        sys.stderr.write(f"ERROR: {error}\n")
        return 2
    if args.check:
        return check_fresh(
            stale(rendered, args.json_dir),
            args.json_dir,
            what="dashboard JSON",
            command="python dashboards/generate.py",
        )
    for name in write(rendered, args.json_dir):
        print(f"wrote {args.json_dir / name}" if name in rendered else f"removed {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
