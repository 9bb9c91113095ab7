"""The shipped Alertmanager routing: valid for amtool, severities routed as documented, and
inhibitions that name only alerts the rules define."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from stabmon import contract

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
ALL_ALERTS = {*contract.ALERT_NAMES, *contract.EXTENSION_ALERT_NAMES}


def _amtool() -> str:
    found = shutil.which("amtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("amtool is not installed; CI must check the Alertmanager config")
        pytest.skip("Requires: amtool (apt-get install prometheus-alertmanager)")
    return found


def test_alertmanager_config_passes_amtool_check_config() -> None:
    result = subprocess.run([_amtool(), "check-config", str(CONFIG)], capture_output=True,
                            text=True, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "inhibit rules" in result.stdout


@pytest.mark.parametrize(
    ("severity", "receivers"),
    [
        ("critical", "pagerduty,webhook,slack"),
        ("warning", "webhook,slack"),
        ("info", "dashboards-only"),
    ],
)
def test_alertmanager_routes_each_severity_to_its_receivers(severity: str, receivers: str) -> None:
    result = subprocess.run(
        [_amtool(), "config", "routes", "test", f"--config.file={CONFIG}",
         f"severity={severity}", "alertname=StabmonTrainingStalled", "run=r"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.stdout.strip() == receivers, result.stdout + result.stderr


def test_alertmanager_inhibitions_name_only_alerts_the_rules_define() -> None:
    document = yaml.safe_load(CONFIG.read_text())
    named: set[str] = set()
    for rule in document["inhibit_rules"]:
        assert rule["equal"], "an inhibition without equal: would mute every alert of a kind"
        for matcher in (*rule["source_matchers"], *rule["target_matchers"]):
            match = re.fullmatch(r'alertname=~?"([^"]+)"', matcher)
            assert match, matcher
            named |= set(match.group(1).split("|"))
    assert named <= ALL_ALERTS, named - ALL_ALERTS
    assert "StabmonDaemonDown" in named


def test_alertmanager_config_keeps_secrets_in_files() -> None:
    text = CONFIG.read_text()
    assert "api_url_file:" in text and "routing_key_file:" in text
    assert not re.search(r"\b(api_url|routing_key|service_key):\s", text)
    assert not re.search(r"hooks\.slack\.com", text)
