"""The generated Grafana dashboards: fresh, built from contract names only, and complete."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from stabmon import contract

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
JSON_DIR = DASHBOARDS / "json"
TRAINING_UID = "stabmon-training"
GPU_NODES_UID = "stabmon-gpu-nodes"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

CONTRACT_METRICS = {
    m.name: m
    for m in (
        *contract.TRAINING_METRICS,
        *contract.DAEMON_METRICS,
        *contract.EXTENSION_METRICS,
        *contract.HANG_METRICS,
        contract.DAEMON_POLL_DURATION,
        contract.DAEMON_LAST_POLL,
    )
}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"dashboards_{name}", DASHBOARDS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


generate = _load("generate")
panels = _load("panels")


def _dashboard(uid: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((JSON_DIR / f"{uid}.json").read_text(encoding="utf-8"))
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def _panel_expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", []) if t.get("expr")]


#: Parts of PromQL that hold label names or values, never metric names.
_NOT_METRICS = re.compile(
    r'"(?:[^"\\]|\\.)*"'  # strings: label values, regexes, $variables
    r"|\{[^}]*\}"  # label matchers
    r"|\[[^\]]*\]"  # range windows
    r"|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"  # label lists
)
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*\b(?!\s*\()")  # not a function call
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def _metric_names(expr: str) -> set[str]:
    """Every metric name an expression selects, histogram suffixes removed."""
    names = set()
    for token in _IDENTIFIER.findall(_NOT_METRICS.sub(" ", expr)):
        if token.lower() in _KEYWORDS:
            continue
        base = re.sub(r"_(?:bucket|sum|count)$", "", token)
        histogram = base in CONTRACT_METRICS and CONTRACT_METRICS[base].type == "histogram"
        names.add(base if histogram else token)
    return names


def test_committed_dashboard_json_is_what_generate_writes() -> None:
    assert generate.stale(generate.render_all(), JSON_DIR) == []


def test_generate_check_fails_naming_the_stale_file_when_json_was_edited_by_hand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path in JSON_DIR.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    edited = tmp_path / f"{TRAINING_UID}.json"
    edited.write_text(edited.read_text(encoding="utf-8").replace("Loss", "Lost"), encoding="utf-8")

    assert generate.main(["--check", "--json-dir", str(tmp_path)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert re.search(rf"stale dashboard JSON .*{TRAINING_UID}\.json", error)
    assert GPU_NODES_UID not in error


def test_generate_writes_every_dashboard_and_removes_json_without_a_source(tmp_path: Path) -> None:
    (tmp_path / "renamed-long-ago.json").write_text("{}\n", encoding="utf-8")

    assert generate.main(["--json-dir", str(tmp_path)]) == 0

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in JSON_DIR.iterdir())
    for path in JSON_DIR.glob("*.json"):
        assert (tmp_path / path.name).read_bytes() == path.read_bytes()
    assert generate.main(["--check", "--json-dir", str(tmp_path)]) == 0


def test_dashboards_have_their_stable_uids_as_file_names() -> None:
    uids = {path.stem: _dashboard(path.stem)["uid"] for path in JSON_DIR.glob("*.json")}
    assert uids == {TRAINING_UID: TRAINING_UID, GPU_NODES_UID: GPU_NODES_UID}


@pytest.mark.parametrize("uid", [TRAINING_UID, GPU_NODES_UID])
def test_dashboard_expressions_select_only_contract_metrics(uid: str) -> None:
    dashboard = _dashboard(uid)
    variables = [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    selectors = [re.fullmatch(r"label_values\((.+), *\w+\)", query) for query in variables]
    assert all(selectors), variables
    queries = generate.expressions(dashboard) + [m.group(1) for m in selectors if m]
    # Besides the contract's metrics, what the shipped rules record (fleet aggregates).
    known = set(CONTRACT_METRICS) | panels.recorded_series()
    unknown = {expr: _metric_names(expr) - known for expr in queries}
    assert {expr: names for expr, names in unknown.items() if names} == {}
    assert all(_metric_names(expr) for expr in generate.expressions(dashboard))


@pytest.mark.parametrize("uid", [TRAINING_UID, GPU_NODES_UID])
def test_dashboard_expressions_never_select_by_job_or_instance(uid: str) -> None:
    by_scrape_target = re.compile(r"\b(?:job|instance)\s*(?:=~|!~|!=|=)")
    assert [e for e in generate.expressions(_dashboard(uid)) if by_scrape_target.search(e)] == []


@pytest.mark.parametrize("uid", [TRAINING_UID, GPU_NODES_UID])
def test_dashboard_panels_are_timeseries_or_stat_in_rows(uid: str) -> None:
    kinds = {panel["type"] for panel in _panels(_dashboard(uid))}
    assert kinds <= {"timeseries", "stat", "row"}
    assert {"timeseries", "stat"} <= kinds


@pytest.mark.parametrize("uid", [TRAINING_UID, GPU_NODES_UID])
def test_dashboard_panels_targets_and_annotations_query_the_datasource_variable(uid: str) -> None:
    dashboard = _dashboard(uid)
    queried = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert queried
    assert all(p["datasource"] == DATASOURCE for p in queried)
    assert all(t["datasource"] == DATASOURCE for p in queried for t in p["targets"])
    assert all(a["datasource"] == DATASOURCE for a in dashboard["annotations"]["list"])
    queries = [v for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert all(v["datasource"] == DATASOURCE for v in queries)


@pytest.mark.parametrize("uid", [TRAINING_UID, GPU_NODES_UID])
def test_dashboard_has_a_prometheus_datasource_variable(uid: str) -> None:
    variables = {v["name"]: v for v in _dashboard(uid)["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_training_dashboard_filters_by_multi_value_run_and_rank_variables() -> None:
    variables = {v["name"]: v for v in _dashboard(TRAINING_UID)["templating"]["list"]}
    for name in ("run", "rank"):
        assert variables[name]["multi"] and variables[name]["includeAll"]
        assert contract.BUILD_INFO.name in variables[name]["query"]
    # Run-level figures combine every rank of the run on purpose (the global gradient norm).
    # So do the recorded per-run and per-node aggregates, filtered by run only.
    run_level = re.compile(r'^sqrt\(sum by \(run\) |^run(_node)?:stabmon_\w+:\w+\{run=~"\$run"\}')
    unfiltered = [
        expr
        for expr in generate.expressions(_dashboard(TRAINING_UID))
        if 'run=~"$run"' not in expr or ('rank=~"$rank"' not in expr and not run_level.match(expr))
    ]
    assert unfiltered == []


def _recorded_in_group(name: str) -> set[str]:
    groups = yaml.safe_load(panels.RULES_FILE.read_text(encoding="utf-8"))["groups"]
    group = next(g for g in groups if g["name"] == name)
    return {rule["record"] for rule in group["rules"] if "record" in rule}


def test_every_fleet_aggregate_and_node_forecast_is_on_a_dashboard() -> None:
    # Issue 39: at thousands of ranks the first panels to open read one series a run or a node,
    # recorded once a minute, not every rank's raw series at every refresh.
    # (The 4-hour forecasts are the paging alert's; the panel shows the 72-hour horizon.)
    fleet = _recorded_in_group("stabmon.aggregates") | {
        name
        for name in _recorded_in_group("stabmon.forecasts")
        if name.startswith("node:") and not name.endswith("predict4h_ratio")
    }
    shown: set[str] = set()
    for uid in (TRAINING_UID, GPU_NODES_UID):
        shown |= set().union(*map(_metric_names, generate.expressions(_dashboard(uid))))
    assert sorted(fleet - shown) == []
    assert {name.split(":")[0] for name in fleet} == {"run", "run_node", "node"}


def test_no_dashboard_computes_a_run_median_over_every_ranks_raw_series() -> None:
    # The straggler panel reads the ratio StabmonStragglerRank reads, recorded with each run's
    # median, instead of three quantiles over every rank per refresh.
    expressions = generate.expressions(_dashboard(TRAINING_UID))
    assert [expr for expr in expressions if "quantile by" in expr] == []
    assert any(
        expr.startswith("run_rank:stabmon_step_duration_seconds:ratio_to_run_median10m{")
        for expr in expressions
    )


def test_recorded_rejects_a_series_no_rule_records() -> None:
    assert panels.recorded("run:stabmon_steps:avg_rate5m", 'run=~"$run"') == (
        'run:stabmon_steps:avg_rate5m{run=~"$run"}'
    )
    with pytest.raises(ValueError, match="run:stabmon_made_up:rate5m is recorded by no rule"):
        panels.recorded("run:stabmon_made_up:rate5m")


def test_gpu_nodes_dashboard_has_a_gpu_variable_over_the_utilization_metric() -> None:
    variables = {v["name"]: v for v in _dashboard(GPU_NODES_UID)["templating"]["list"]}
    assert variables["gpu"]["query"] == f"label_values({contract.GPU_UTILIZATION.name}, gpu)"


def test_every_training_metric_is_on_the_training_dashboard() -> None:
    shown = set().union(*map(_metric_names, _panel_expressions(_dashboard(TRAINING_UID))))
    assert [m.name for m in contract.TRAINING_METRICS if m.name not in shown] == []


def test_every_daemon_metric_is_on_the_gpu_nodes_dashboard() -> None:
    shown = set().union(*map(_metric_names, _panel_expressions(_dashboard(GPU_NODES_UID))))
    daemon = (*contract.DAEMON_METRICS, contract.DAEMON_POLL_DURATION, contract.DAEMON_LAST_POLL)
    assert [m.name for m in daemon if m.name not in shown] == []


def test_training_dashboard_annotates_anomalies() -> None:
    annotations = _dashboard(TRAINING_UID)["annotations"]["list"]
    assert [_metric_names(a["expr"]) for a in annotations] == [{contract.ANOMALIES.name}]


def test_expressions_lists_every_target_then_every_annotation() -> None:
    dashboard = _dashboard(TRAINING_UID)
    annotations = [a["expr"] for a in dashboard["annotations"]["list"]]

    found = generate.expressions(dashboard)

    assert found == _panel_expressions(dashboard) + annotations
    assert all(isinstance(expr, str) and expr for expr in found)


def test_expressions_looks_inside_collapsed_rows() -> None:
    target = {"expr": contract.LOSS.name, "refId": "A"}
    collapsed = {"type": "row", "panels": [{"type": "timeseries", "targets": [target]}]}
    assert generate.expressions({"panels": [collapsed]}) == [contract.LOSS.name]


def test_generate_rejects_a_dashboard_file_without_a_dashboard(tmp_path: Path) -> None:
    (tmp_path / "empty.dashboard.py").write_text("title = 'no dashboard here'\n")
    with pytest.raises(generate.DashboardDefinitionError, match="expected a grafanalib Dashboard"):
        generate.render_all(tmp_path)


def test_selector_rejects_a_histogram_suffix_on_a_gauge() -> None:
    with pytest.raises(ValueError, match="suffix '_bucket' on gauge stabmon_loss"):
        panels.selector(contract.LOSS, suffix="_bucket")


def test_rate_rejects_a_gauge() -> None:
    with pytest.raises(ValueError, match=r"rate\(\) of gauge stabmon_grad_norm"):
        panels.rate(contract.GRAD_NORM)


def test_rate_of_a_histogram_needs_a_series_suffix() -> None:
    with pytest.raises(ValueError, match="pick a suffix"):
        panels.rate(contract.STEP_DURATION)


def test_quantile_reads_the_histogram_buckets_per_rank() -> None:
    expr = panels.quantile(0.99, contract.STEP_DURATION, *panels.RUN_RANK)
    assert expr == (
        "histogram_quantile(0.99, sum by (le, run, rank) (rate(stabmon_step_duration_seconds"
        '_bucket{run=~"$run", rank=~"$rank"}[$__rate_interval])))'
    )
