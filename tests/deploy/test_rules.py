"""The shipped alert rules: complete against the contract, documented, and proven by promtool.

The structural checks run everywhere; `promtool check rules` and `promtool test rules` need
Debian's prometheus package (`make tools`). They skip without it on a developer machine and
fail in CI, where a silently skipped rule test would hide a broken rule.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from stabmon import contract

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "stabmon.rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "stabmon.rules.test.yml"
# Daemon restarts and outages, frozen ranks, exit classes, gaps, forecasts (issue 22).
RESILIENCE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "stabmon.resilience.test.yml"
# The stabmon.throughput group (issue 27).
THROUGHPUT_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "stabmon.throughput.test.yml"
# How fast a frozen rank pages, at a 5 s evaluation interval (issue 22).
FROZEN_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "stabmon.frozen.test.yml"
# The for: durations the end-to-end tests shorten, at a 15 s evaluation interval.
FOR_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "stabmon.for.test.yml"
# The leak rules over 6 to 24 hours, at a 5-minute evaluation interval.
MEMORY_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "stabmon.memory.test.yml"
# The per-run and per-node aggregates and the recorded forecasts, at 1 min (issue 39).
AGGREGATES_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "stabmon.aggregates.test.yml"
PROMTOOL_TESTS = (RULE_TESTS, RESILIENCE_TESTS, THROUGHPUT_TESTS, FROZEN_TESTS, FOR_TESTS,
                  MEMORY_TESTS, AGGREGATES_TESTS)  # fmt: skip
ALL_ALERTS = (*contract.ALERT_NAMES, *contract.EXTENSION_ALERT_NAMES)
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_BASE = "https://github.com/stabmon/stabmon/blob/main/docs/runbooks.md#"

METRIC_NAMES = {
    m.name
    for m in (
        *contract.TRAINING_METRICS,
        *contract.DAEMON_METRICS,
        *contract.EXTENSION_METRICS,
        *contract.DAEMON_EXTENSION_METRICS,
        *contract.HANG_METRICS,
        contract.DAEMON_POLL_DURATION,
        contract.DAEMON_LAST_POLL,
    )
}
# Histograms are read through their sample series.
SERIES_NAMES = METRIC_NAMES | {
    f"{name}{suffix}" for name in METRIC_NAMES for suffix in ("_bucket", "_sum", "_count")
}
# Alerts whose value is a state (process up == 0, metrics absent), not a figure to quote.
STATE_ALERTS = {
    "StabmonTrainingProcessDown",
    "StabmonTrainingProcessTerminated",
    "StabmonTrainingMetricsAbsent",
}
# Alerts about the daemon itself, which name its target rather than a rank or a GPU.
DAEMON_ALERTS = {"StabmonDaemonDown", "StabmonDaemonNvmlDown"}
# Alerts split over several rules (one page, different for: durations): the in-process legs of
# a stall and the daemon's frozen-rank leg.
MULTI_RULE_ALERTS = {"StabmonTrainingStalled"}
# Prometheus' own series that a rule may join with (target health).
PROMETHEUS_SERIES = {"up"}


def _rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules() if "alert" in rule]


def _recorded() -> dict[str, list[dict[str, Any]]]:
    """The recording rules by the series they record, in file order."""
    recorded: dict[str, list[dict[str, Any]]] = {}
    for rule in _rules():
        if "record" in rule:
            recorded.setdefault(rule["record"], []).append(rule)
    return recorded


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed; CI must run the rule tests (make tools)")
        pytest.skip("Requires: promtool (apt-get install prometheus)")
    return found


def _strip_comments(expr: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in expr.splitlines())


def _series_names(expr: str) -> set[str]:
    """Identifiers in a PromQL expression that name series (not functions or keywords)."""
    code = _strip_comments(expr)
    code = re.sub(r'"[^"]*"', '""', code)  # label values
    code = re.sub(r"\{[^}]*\}", "{}", code)  # matchers
    code = re.sub(r"\[[^\]]*\]", "[]", code)  # ranges and subquery steps ([1h:1m])
    code = re.sub(r"\b(?:by|on|ignoring|without|group_left|group_right)\s*\([^)]*\)", "", code)
    names = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b(?!\s*\()", code))
    keywords = {"and", "or", "unless", "offset", "bool", "group_left", "group_right"}
    durations = {n for n in names if re.fullmatch(r"\d*[smhdwy]", n)}
    return names - keywords - durations


def _rules_of(alert: str) -> list[dict[str, Any]]:
    return [rule for rule in _alerts() if rule["alert"] == alert]


def test_every_alert_is_one_rule_or_rules_sharing_severity_and_annotations() -> None:
    names = [rule["alert"] for rule in _alerts()]
    assert sorted(set(names)) == sorted(ALL_ALERTS)
    assert {name for name in names if names.count(name) > 1} <= MULTI_RULE_ALERTS
    for alert in MULTI_RULE_ALERTS:
        rules = _rules_of(alert)
        assert len({rule["labels"]["severity"] for rule in rules}) == 1
        assert all(rule["annotations"] == rules[0]["annotations"] for rule in rules)


@pytest.mark.parametrize("alert", ALL_ALERTS)
def test_alert_has_severity_and_annotations(alert: str) -> None:
    rule = _rules_of(alert)[0]  # the others share its severity and annotations
    assert rule["labels"]["severity"] in contract.SEVERITIES
    annotations = rule["annotations"]
    assert set(annotations) >= {"summary", "description", "runbook_url"}
    assert annotations["summary"].strip()
    # The description names the run and the rank (or the GPU for node alerts), and the value
    # where the value is a measurement rather than a state.
    description = annotations["description"]
    assert ("$value" in description) != (alert in STATE_ALERTS)
    if alert in DAEMON_ALERTS:
        assert "$labels.instance" in description
    else:
        assert "$labels.rank" in description or "$labels.uuid" in description
    assert annotations["runbook_url"] == RUNBOOK_BASE + alert.lower()


@pytest.mark.parametrize("alert", ALL_ALERTS)
def test_runbook_has_a_section_for_each_alert(alert: str) -> None:
    sections = re.findall(r"^## (\S+)$", RUNBOOKS.read_text(), flags=re.MULTILINE)
    assert alert in sections
    body = RUNBOOKS.read_text().split(f"## {alert}\n", 1)[1].split("\n## ", 1)[0]
    assert "**Confirm.**" in body and "**What to do.**" in body


@pytest.mark.parametrize("alert", ALL_ALERTS)
def test_rules_read_only_contract_series_and_never_select_by_job_or_instance(
    alert: str,
) -> None:
    # Besides contract series, an alert may read what this file's recording rules record.
    for rule in _rules_of(alert):
        expr = _strip_comments(rule["expr"])
        allowed = SERIES_NAMES | PROMETHEUS_SERIES | set(_recorded())
        assert _series_names(expr) <= allowed, _series_names(expr) - allowed
        assert not re.search(r"\b(job|instance)\s*(=|!=|=~|!~)", expr), "selects by job/instance"


def test_recording_rules_read_contract_series_or_series_recorded_before_them() -> None:
    # Before them in the same group: a group evaluates its rules in order, so a rule that read
    # a series recorded later (or in another group) would read the previous evaluation's value.
    document = yaml.safe_load(RULES.read_text())
    recording = 0
    for group in document["groups"]:
        recorded: set[str] = set()
        for rule in group["rules"]:
            names = _series_names(rule["expr"])
            if "record" in rule:
                recording += 1
                assert names <= SERIES_NAMES | PROMETHEUS_SERIES | recorded, (
                    rule["record"],
                    names - SERIES_NAMES - recorded,
                )
                expr = _strip_comments(rule["expr"])
                assert not re.search(r"\b(job|instance)\s*(=|!=|=~|!~)", expr), rule["record"]
                recorded.add(rule["record"])
            else:
                # An alert reads recorded series of its own group only.
                assert names & set(_recorded()) <= recorded, (rule["alert"], group["name"])
    assert recording > 0


def test_recorded_series_are_named_level_metric_operations_once_each() -> None:
    # Prometheus' convention: level:metric:operations, the metric one of the contract's (a
    # counter without its _total once rated).
    for name, rules in _recorded().items():
        assert len(rules) == 1, f"{name} is recorded by {len(rules)} rules"
        level, metric, operations = name.split(":")
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", level), name
        assert {metric, f"{metric}_total"} & METRIC_NAMES, (
            f"{name}: {metric} is not in the contract"
        )
        assert re.fullmatch(r"[a-z0-9_]+", operations), name
        assert not name.startswith("stabmon_"), name


def test_forecasts_are_recorded_once_and_alerts_and_fleet_views_read_them() -> None:
    # Each GPU's and each node's trend is fitted once a minute by a recording rule; the alerts
    # compare the recorded ratios (issue 39), so no alert fits a trend itself.
    groups = {g["name"]: g for g in yaml.safe_load(RULES.read_text())["groups"]}
    forecasts = groups["stabmon.forecasts"]["rules"]
    fitted = [r["record"] for r in forecasts if "predict_linear" in r.get("expr", "")]
    assert sorted(fitted) == [
        "gpu:stabmon_gpu_memory_used_bytes:predict4h_ratio",
        "gpu:stabmon_gpu_memory_used_bytes:predict72h_ratio",
        "node:stabmon_process_memory_bytes:predict4h_ratio",
        "node:stabmon_process_memory_bytes:predict72h_ratio",
    ]
    assert [r["alert"] for r in _alerts() if "predict_linear" in r["expr"]] == []
    assert "node:stabmon_gpu_memory_used_bytes:max_predict72h_ratio" in _recorded()


def test_fleet_aggregates_keep_one_series_a_run_or_a_node() -> None:
    # What a dashboard over thousands of ranks reads: aggregated by run, by (run, node), or
    # per daemon target without the GPU's own labels; no alert reads them.
    group = next(
        g for g in yaml.safe_load(RULES.read_text())["groups"] if g["name"] == "stabmon.aggregates"
    )
    for rule in group["rules"]:
        level = rule["record"].split(":")[0]
        expr = _strip_comments(rule["expr"])
        if level == "run":
            assert re.match(r"(avg|min|max|sum|count) by \(run(, kind)?\)", expr), expr
        elif level == "run_node":
            assert re.match(r"(avg|sum) by \(run, node(, kind)?\)", expr), expr
        else:
            assert level == "node" and re.match(r"(avg|sum) without \(gpu, uuid", expr), expr
    aggregates = {rule["record"] for rule in group["rules"]}
    assert [a["alert"] for a in _alerts() if _series_names(a["expr"]) & aggregates] == []


def test_the_contract_check_is_strict_about_series_the_file_does_not_record() -> None:
    assert _series_names("run:stabmon_made_up:median10m > 1") == {"run:stabmon_made_up:median10m"}
    assert "run:stabmon_made_up:median10m" not in SERIES_NAMES | set(_recorded())
    assert _series_names("stabmon_not_in_the_contract") - SERIES_NAMES


def test_every_rule_has_a_comment_explaining_its_threshold() -> None:
    text = RULES.read_text()
    for alert in ALL_ALERTS:
        for before in text.split(f"- alert: {alert}\n")[:-1]:
            assert before.rstrip().splitlines()[-1].strip().startswith("#"), (
                f"{alert} has no comment"
            )


def test_each_alert_has_a_firing_and_a_quiet_promtool_case() -> None:
    fired: set[str] = set()
    quiet: set[str] = set()
    for path in PROMTOOL_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == set(ALL_ALERTS)
    assert quiet == set(ALL_ALERTS)


def test_promtool_check_rules() -> None:
    result = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


@pytest.mark.parametrize(
    "tests",
    [
        # A simulated day of the leak rules: the quick loop (-m "not slow") leaves it to CI.
        pytest.param(path, marks=pytest.mark.slow) if path == MEMORY_TESTS else path
        for path in PROMTOOL_TESTS
    ],
    ids=lambda path: path.name,
)
def test_promtool_test_rules(tests: Path) -> None:
    result = subprocess.run(
        [_promtool(), "test", "rules", tests.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
