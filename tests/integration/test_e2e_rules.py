"""The rules the end-to-end tests load are the shipped file, but for shorter ``for:`` values.

test_alerting_e2e and test_prometheus_e2e wait for alerts from real processes. Waiting out the
shipped ``for: 1m`` and ``for: 2m`` in real time cost minutes per run, so they load a copy of
deploy/prometheus/rules/stabmon.rules.yml whose only change is the ``for:`` of the rules they
wait for (realstack.SHORTER_FOR). These tests keep that honest: the copy differs from the
shipped file in nothing but those ``for:`` lines (so the end-to-end tests still run the shipped
expressions, labels and annotations), and the shipped durations are proven on simulated time
instead: promtool's tests of the shipped file (stabmon.for.test.yml) fail with each shorter
value. Not slow: promtool on a few cases, no real processes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from realstack import (
    RULES,
    SHORTER_FOR,
    differences_besides_for,
    require,
    rules_with_for,
)

FOR_TESTS = RULES.parents[1] / "tests" / "stabmon.for.test.yml"


def test_the_end_to_end_rules_differ_from_the_shipped_file_only_in_for() -> None:
    shipped = RULES.read_text()
    shortened = rules_with_for(SHORTER_FOR)
    assert differences_besides_for(shipped, shortened) == []
    changed = [
        (old.strip(), new.strip())
        for old, new in zip(shipped.splitlines(), shortened.splitlines(), strict=True)
        if old != new
    ]
    assert sorted(new for _, new in changed) == sorted(f"for: {v}" for v in SHORTER_FOR.values())
    assert all(old.startswith("for: ") for old, _ in changed)


def test_a_change_besides_for_is_caught() -> None:
    shipped = RULES.read_text()
    relabelled = rules_with_for(SHORTER_FOR).replace("severity: warning", "severity: info", 1)
    assert differences_besides_for(shipped, relabelled) != []
    reworded = shipped.replace("for: 1m", "for: 1m  # a comment", 1)
    assert differences_besides_for(shipped, reworded) != []


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(AssertionError, match="no such rule"):
        rules_with_for({("StabmonTrainingStalled", 2): "1s"})


def _promtool_for_tests(rules: Path, work: Path) -> subprocess.CompletedProcess[str]:
    require("promtool")
    document = yaml.safe_load(FOR_TESTS.read_text())
    document["rule_files"] = [str(rules)]
    tests = work / FOR_TESTS.name
    tests.write_text(yaml.safe_dump(document))
    return subprocess.run(
        ["promtool", "test", "rules", str(tests)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_promtool_passes_the_for_tests_on_the_shipped_rules(tmp_path: Path) -> None:
    rules = tmp_path / RULES.name
    rules.write_text(RULES.read_text())
    result = _promtool_for_tests(rules, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("rule", sorted(SHORTER_FOR), ids=lambda rule: f"{rule[0]}[{rule[1]}]")
def test_promtool_fails_the_shipped_file_with_the_end_to_end_for(
    rule: tuple[str, int], tmp_path: Path
) -> None:
    rules = tmp_path / RULES.name
    rules.write_text(rules_with_for({rule: SHORTER_FOR[rule]}))
    result = _promtool_for_tests(rules, tmp_path)
    assert result.returncode != 0, result.stdout
    assert f"alertname: {rule[0]}" in result.stdout + result.stderr
