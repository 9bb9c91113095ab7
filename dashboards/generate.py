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


def render(dashboard: Any) -> str:
    """The dashboard as committed: sorted keys, two-space indent, a trailing newline."""
    data = dashboard.to_json_data()
    return json.dumps(data, cls=DashboardEncoder, sort_keys=True, indent=2) + "\n"


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
