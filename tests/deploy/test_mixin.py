"""deploy/mixin: the monitoring mixin, generated from the rules file and the dashboards (issue 39).

Fresh (as ``--check`` runs in ``make test``), complete (every group and dashboard, unchanged),
every alert with its runbook, and a config whose selectors and thresholds are, verbatim, what
the rules use: a rule edited without its config entry fails here, and so does a config entry
edited without its rules. ``--config`` renders a mixin with other values, which promtool
accepts.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from deploy_helpers import DEPLOY, RULES_FILE, load_yaml, required_tool, run_tool

MIXIN = DEPLOY / "mixin"
DASHBOARD_JSON = DEPLOY.parent / "dashboards" / "json"
RUNBOOKS = DEPLOY.parent / "docs" / "runbooks.md"


def _load_generate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mixin_generate", MIXIN / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


generate = _load_generate()


def _groups(path: Path) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = load_yaml(path)["groups"]
    return groups


def _exprs(groups: list[dict[str, Any]], name: str) -> list[str]:
    return [
        generate.normalized(rule["expr"])
        for group in groups
        for rule in group["rules"]
        if generate.rule_name(rule) == name
    ]


def _all_exprs(groups: list[dict[str, Any]]) -> list[str]:
    return [generate.normalized(rule["expr"]) for group in groups for rule in group["rules"]]


def _copy_rules(tmp_path: Path, old: str, new: str, count: int = 1) -> Path:
    text = RULES_FILE.read_text(encoding="utf-8")
    assert text.count(old) >= count, old
    path = tmp_path / "stabmon.rules.yml"
    path.write_text(text.replace(old, new, count), encoding="utf-8")
    return path


# --- fresh and complete -------------------------------------------------------------------------


def test_committed_mixin_is_what_generate_writes() -> None:
    assert generate.stale(generate.render_all()) == []
    assert generate.main(["--check"]) == 0


def test_check_fails_naming_a_hand_edited_file_and_a_dashboard_without_a_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(MIXIN, tmp_path / "mixin", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "mixin"
    alerts = out / "alerts.yaml"
    alerts.write_text(alerts.read_text().replace("for: 15m", "for: 20m", 1), encoding="utf-8")
    (out / "dashboards" / "renamed-long-ago.json").write_text("{}\n", encoding="utf-8")

    assert generate.main(["--check", "--out", str(out)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "alerts.yaml, dashboards/renamed-long-ago.json;" in error
    assert "run: python deploy/mixin/generate.py" in error

    assert generate.main(["--out", str(out)]) == 0
    assert not (out / "dashboards" / "renamed-long-ago.json").exists()
    assert generate.main(["--check", "--out", str(out)]) == 0


def test_alerts_and_rules_hold_every_group_of_the_rules_file_unchanged() -> None:
    alerts, rules = _groups(MIXIN / "alerts.yaml"), _groups(MIXIN / "rules.yaml")
    source = _groups(RULES_FILE)
    # Alerting groups whole (each alert reads series recorded before it in its own group),
    # in the file's order; recording-only groups apart.
    assert alerts == [g for g in source if any("alert" in r for r in g["rules"])]
    assert rules == [g for g in source if g not in alerts]
    assert [g["name"] for g in rules] == ["stabmon.aggregates"]
    assert all("record" in rule for group in rules for rule in group["rules"])


def test_dashboards_are_the_generated_json_byte_for_byte() -> None:
    shipped = sorted(p.name for p in (MIXIN / "dashboards").iterdir())
    assert shipped == sorted(p.name for p in DASHBOARD_JSON.glob("*.json"))
    for name in shipped:
        assert (MIXIN / "dashboards" / name).read_bytes() == (DASHBOARD_JSON / name).read_bytes()


@pytest.mark.parametrize("name", ["alerts.yaml", "rules.yaml"])
def test_promtool_accepts_the_mixin_rules(name: str) -> None:
    result = run_tool(required_tool("promtool", "prometheus"), "check", "rules", MIXIN / name)
    assert result.returncode == 0, result.stdout + result.stderr


# --- runbooks ---------------------------------------------------------------------------------


def test_every_alert_of_the_mixin_links_its_runbook_section() -> None:
    sections = set(re.findall(r"^## (\S+)$", RUNBOOKS.read_text(encoding="utf-8"), re.M))
    alerts = [
        rule for g in _groups(MIXIN / "alerts.yaml") for rule in g["rules"] if "alert" in rule
    ]
    assert len({rule["alert"] for rule in alerts}) == len(
        load_yaml(MIXIN / "config.yaml")["alerts"]
    )
    for rule in alerts:
        name = rule["alert"]
        assert rule["annotations"]["runbook_url"] == generate.RUNBOOK_BASE + name.lower()
        assert name in sections


def test_generate_refuses_an_alert_without_a_runbook_url(tmp_path: Path) -> None:
    old = "runbook_url: https://github.com/stabmon/stabmon/blob/main/docs/runbooks.md#stabmonlossspike"
    rules = _copy_rules(tmp_path, f"          {old}\n", "")
    with pytest.raises(generate.SourceError, match="alert StabmonLossSpike .*runbook_url"):
        generate.render_all(rules_file=rules)


def test_generate_refuses_a_runbook_url_to_a_section_that_does_not_exist(tmp_path: Path) -> None:
    rules = _copy_rules(tmp_path, "#stabmonlossspike", "#stabmonlossspikes")
    with pytest.raises(generate.SourceError, match="StabmonLossSpike"):
        generate.render_all(rules_file=rules)


# --- the config: what the rules use ------------------------------------------------------------


def test_config_selectors_are_the_matchers_the_rules_use() -> None:
    config = load_yaml(MIXIN / "config.yaml")["selectors"]
    groups = _groups(RULES_FILE)
    assert set(config) == set(generate.SELECTORS)
    for name, selector in generate.SELECTORS.items():
        entry = config[name]
        assert entry["matcher"] == selector.matcher()
        for rule in entry["used_by"]:
            assert any(entry["matcher"] in expr for expr in _exprs(groups, rule)), (name, rule)
        # No rule anywhere matches this label with this operator on another value.
        same_kind = re.compile(rf'\b{selector.label}{re.escape(selector.op)}"[^"]*"')
        assert {m for e in _all_exprs(groups) for m in same_kind.findall(e)} == {entry["matcher"]}


def test_config_thresholds_are_the_numbers_the_rules_use() -> None:
    config = load_yaml(MIXIN / "config.yaml")["thresholds"]
    groups = _groups(RULES_FILE)
    assert set(config) == set(generate.THRESHOLDS)
    for name, threshold in generate.THRESHOLDS.items():
        value = config[name]["value"]
        assert value == threshold.value
        assert config[name]["used_by"] == sorted({rule for rule, _ in threshold.uses})
        for rule, fragment in threshold.uses:
            written = fragment.replace("{}", f"{value:g}")
            assert any(written in expr for expr in _exprs(groups, rule)), (name, written)


def test_config_lists_each_alerts_for_and_severity_as_the_rules_say() -> None:
    config = load_yaml(MIXIN / "config.yaml")["alerts"]
    for group in _groups(RULES_FILE):
        for rule in group["rules"]:
            if "alert" in rule:
                entry = config[rule["alert"]]
                assert entry["severity"] == rule["labels"]["severity"]
                assert entry["group"] == group["name"]
                assert rule["for"] in (
                    [entry["for"]] if isinstance(entry["for"], str) else entry["for"]
                )


@pytest.mark.parametrize(
    ("old", "new", "count", "error"),
    [
        # One rule's straggler ratio changed, not the other's, nor the config.
        ("ratio_to_run_median10m > 1.2)", "ratio_to_run_median10m > 1.3)", 1, "differ"),
        # A new place of the number that no fragment of the config covers.
        ("> 0.02\n", "> 0.02 and 0.02 > 0\n", 1, "writes 0.02 3 times"),
        # A selector's regex edited in one rule only.
        (
            'phase=~"data_wait|forward|backward|optimizer"',
            'phase=~"data_wait|forward"',
            1,
            "differ",
        ),
        # A fragment that no longer matches: the threshold's place was rewritten.
        ("stabmon_amp_loss_scale <= 1", "stabmon_amp_loss_scale < 1.5", 1, "no 'stabmon_amp"),
    ],
    ids=["one-place-changed", "uncovered-place", "selector-drift", "fragment-gone"],
)
def test_generate_fails_when_the_rules_drift_from_the_config(
    tmp_path: Path, old: str, new: str, count: int, error: str
) -> None:
    rules = _copy_rules(tmp_path, old, new, count)
    with pytest.raises(generate.SourceError, match=re.escape(error)):
        generate.render_all(rules_file=rules)


# --- --config ---------------------------------------------------------------------------------


def test_config_overrides_change_exactly_the_rules_they_name(tmp_path: Path) -> None:
    overrides = {
        "thresholds": {"straggler_ratio": 1.5, "leak_fast_growth": 0.03},
        "selectors": {"throttle_reasons": "hw_thermal_slowdown|sw_thermal_slowdown"},
        "alerts": {
            "StabmonStragglerRank": {"for": "30m"},
            "StabmonTrainingStalled": {"for": ["2m", "10s"]},
        },
    }
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump(overrides), encoding="utf-8")
    out = tmp_path / "site-mixin"

    assert generate.main(["--config", str(site), "--out", str(out)]) == 0

    shipped, changed = _groups(MIXIN / "alerts.yaml"), _groups(out / "alerts.yaml")
    for name in ("StabmonStragglerRank", "StabmonTrainingSlowdown"):
        (expr,) = _exprs(changed, name)
        assert "ratio_to_run_median10m > 1.5)" in expr and "1.2" not in expr
    for name in ("StabmonDeviceMemoryLeak", "StabmonHostMemoryLeak"):
        (expr,) = _exprs(changed, name)
        assert expr.count("> 0.03") == 2 and "0.02" not in expr
    (throttle,) = _exprs(changed, "StabmonGPUThermalThrottling")
    assert 'reason=~"hw_thermal_slowdown|sw_thermal_slowdown"' in throttle
    config = load_yaml(out / "config.yaml")
    assert config["thresholds"]["straggler_ratio"]["value"] == 1.5
    assert config["selectors"]["throttle_reasons"]["matcher"].endswith('sw_thermal_slowdown"')
    assert config["alerts"]["StabmonStragglerRank"]["for"] == "30m"
    assert config["alerts"]["StabmonTrainingStalled"]["for"] == ["2m", "10s"]
    # Every other rule is as shipped.
    touched = {
        "StabmonStragglerRank",
        "StabmonTrainingSlowdown",
        "StabmonDeviceMemoryLeak",
        "StabmonHostMemoryLeak",
        "StabmonGPUThermalThrottling",
        "StabmonTrainingStalled",
    }
    rest = [[r for r in g["rules"] if generate.rule_name(r) not in touched] for g in changed]
    assert rest == [
        [r for r in g["rules"] if generate.rule_name(r) not in touched] for g in shipped
    ]
    result = run_tool(
        required_tool("promtool", "prometheus"), "check", "rules", out / "alerts.yaml"
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"thresholds": {"no_such": 1}}, "unknown threshold 'no_such'"),
        ({"thresholds": {"straggler_ratio": "high"}}, "must be a number"),
        ({"selectors": {"training_phases": 'a"b'}}, "without quotes"),
        ({"alerts": {"StabmonNoSuch": {"for": "1m"}}}, "no alert named"),
        ({"alerts": {"StabmonTrainingStalled": {"for": ["1m"]}}}, "one for: each"),
        ({"rules": {}}, "unknown sections"),
    ],
)
def test_a_bad_config_is_one_error_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: dict[str, Any], error: str
) -> None:
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump(overrides), encoding="utf-8")
    assert generate.main(["--config", str(site), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ERROR: --config: ") and error in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_config_is_refused_over_the_shipped_directory() -> None:
    with pytest.raises(SystemExit) as exited:
        generate.main(["--config", str(MIXIN / "config.yaml")])
    assert exited.value.code == 2


def test_the_documented_site_config_renders_a_mixin_promtool_accepts(tmp_path: Path) -> None:
    docs = (DEPLOY.parent / "docs" / "deployment.md").read_text(encoding="utf-8")
    section = docs.split("### As a monitoring mixin\n", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    (command,) = re.findall(r"```sh\n(.*?)\n```", section, flags=re.S)
    assert command == "python deploy/mixin/generate.py --config site.yaml --out site-mixin"
    (tmp_path / "site.yaml").write_text(example, encoding="utf-8")
    out = tmp_path / "site-mixin"

    assert generate.main(["--config", str(tmp_path / "site.yaml"), "--out", str(out)]) == 0

    config = load_yaml(out / "config.yaml")
    for section_name, values in yaml.safe_load(example).items():
        for name, value in values.items():
            entry = config[section_name][name]
            if section_name == "thresholds":
                assert entry["value"] == value
            elif section_name == "selectors":
                assert entry["matcher"].endswith(f'"{value}"')
            else:
                assert {k: entry[k] for k in value} == value
    result = run_tool(
        required_tool("promtool", "prometheus"), "check", "rules", out / "alerts.yaml"
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", ["stabmon.aggregates.test.yml"])
def test_the_promtool_unit_tests_pass_on_the_mixins_two_rule_files(
    tmp_path: Path, name: str
) -> None:
    # The shipped cases, on alerts.yaml and rules.yaml loaded together instead of the rules
    # file: the split keeps every group whole and its names unique across the two files.
    # The recording rules' cases need both files (the alerts read what rules.yaml records);
    # every alert's own cases run on the rules file itself (tests/deploy/test_rules.py),
    # of which the mixin's groups are byte copies (test_committed_mixin_is_what_generate_...).
    tests = load_yaml(RULES_FILE.parents[1] / "tests" / name)
    assert tests["rule_files"] == ["../rules/stabmon.rules.yml"]
    tests["rule_files"] = [str(MIXIN / "alerts.yaml"), str(MIXIN / "rules.yaml")]
    (tmp_path / name).write_text(yaml.safe_dump(tests, sort_keys=False), encoding="utf-8")
    result = run_tool(required_tool("promtool", "prometheus"), "test", "rules", tmp_path / name)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
