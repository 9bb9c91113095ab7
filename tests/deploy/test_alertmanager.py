"""The shipped Alertmanager routing: valid for amtool, severities routed as documented,
inhibitions that name only alerts the rules define, and (on a real Alertmanager, Debian's
prometheus-alertmanager) node alerts grouped by node and inhibitions that mute only their own
node."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from stabmon import contract

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
COMPOSE_CONFIG = ROOT / "deploy" / "compose" / "alertmanager.yml"
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
            if re.fullmatch(r'(\w+)=~"\.\+"', matcher):
                continue  # a label that must be present (the test below)
            match = re.fullmatch(r'alertname=~?"([^"]+)"', matcher)
            assert match, matcher
            named |= set(match.group(1).split("|"))
    assert named <= ALL_ALERTS, named - ALL_ALERTS
    assert "StabmonDaemonDown" in named


# Labels that some layouts never set (node: only where targets are relabelled with it).
OPTIONAL_LABELS = {"node"}


@pytest.mark.parametrize("config", [CONFIG, COMPOSE_CONFIG], ids=lambda path: path.parent.name)
def test_alertmanager_inhibitions_on_an_optional_label_require_it_on_the_source(
    config: Path,
) -> None:
    # equal: holds between two alerts that both lack the label, so one source without it would
    # mute every target without it, on every node.
    for rule in yaml.safe_load(config.read_text())["inhibit_rules"]:
        for label in OPTIONAL_LABELS & set(rule["equal"]):
            assert f'{label}=~".+"' in rule["source_matchers"], rule


def test_alertmanager_config_keeps_secrets_in_files() -> None:
    text = CONFIG.read_text()
    assert "api_url_file:" in text and "routing_key_file:" in text
    assert not re.search(r"\b(api_url|routing_key|service_key):\s", text)
    assert not re.search(r"hooks\.slack\.com", text)


def test_alertmanager_groups_node_alerts_by_node_and_run_alerts_by_run() -> None:
    for labels, receivers in (
        (["alertname=StabmonGPUXidErrors", "severity=critical", "instance=n1:9399"],
         "pagerduty,webhook,slack"),
        (["alertname=StabmonTrainingStalled", "severity=critical", "run=r", "rank=0"],
         "pagerduty,webhook,slack"),
    ):  # fmt: skip
        result = subprocess.run(
            [_amtool(), "config", "routes", "test", f"--config.file={CONFIG}", *labels],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert result.stdout.strip() == receivers, result.stdout + result.stderr
    route = yaml.safe_load(CONFIG.read_text())["route"]
    (node_route,) = [r for r in route["routes"] if r.get("matchers") == ['run=""']]
    (run_route,) = [r for r in route["routes"] if r.get("matchers") == ['run!=""']]
    assert route["group_by"] == ["alertname", "run"]
    assert node_route["group_by"] == ["alertname", "node", "instance"]
    assert "group_by" not in run_route
    assert node_route["routes"] == run_route["routes"]  # the same receivers by severity


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real Alertmanager on the shipped routing and inhibitions; receivers notify no one."""
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("Alertmanager is not installed; CI must check the routing for real")
        pytest.skip("Requires: alertmanager (apt-get install prometheus-alertmanager)")
    work = tmp_path_factory.mktemp("alertmanager")
    config = yaml.safe_load(CONFIG.read_text())
    config["receivers"] = [{"name": receiver["name"]} for receiver in config["receivers"]]
    (work / "alertmanager.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{_free_port()}"
    process = subprocess.Popen(
        [binary, f"--config.file={work / 'alertmanager.yml'}", f"--storage.path={work / 'data'}",
         f"--web.listen-address={url.removeprefix('http://')}", "--cluster.listen-address=",
         "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _until(lambda: _get(f"{url}/api/v2/status")["config"] is not None, "Alertmanager ready")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def _until(condition: Callable[[], Any], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        time.sleep(0.1)


def _post(url: str, alerts: list[dict[str, str]]) -> None:
    body = json.dumps([{"labels": labels} for labels in alerts]).encode()
    request = urllib.request.Request(
        f"{url}/api/v2/alerts", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5):
        pass


def _groups(url: str, alertname: str) -> list[list[dict[str, str]]]:
    """The label sets of each group of `alertname` that pages (the pagerduty receiver)."""
    return sorted(
        (
            sorted(
                ({k: v for k, v in alert["labels"].items() if k not in ("alertname", "severity")}
                 for alert in group["alerts"]),
                key=str,
            )
            for group in _get(f"{url}/api/v2/alerts/groups")
            if group["receiver"]["name"] == "pagerduty"
            and group["labels"].get("alertname") == alertname
        ),
        key=str,
    )  # fmt: skip


def test_alertmanager_pages_xids_of_two_nodes_apart_and_a_runs_ranks_together(
    alertmanager: str,
) -> None:
    xid = {"alertname": "StabmonGPUXidErrors", "severity": "critical", "uuid": "gpu-a"}
    stalled = {"alertname": "StabmonTrainingStalled", "severity": "critical", "run": "r39"}
    _post(alertmanager, [
        {**xid, "instance": "node1:9399", "xid": "79"},
        {**xid, "instance": "node2:9399", "xid": "48"},
        {**stalled, "rank": "0", "node": "n1"},
        {**stalled, "rank": "1", "node": "n2"},
    ])  # fmt: skip
    _until(lambda: len(_groups(alertmanager, "StabmonGPUXidErrors")) == 2, "two XID groups")
    assert _groups(alertmanager, "StabmonGPUXidErrors") == [
        [{"instance": "node1:9399", "uuid": "gpu-a", "xid": "79"}],
        [{"instance": "node2:9399", "uuid": "gpu-a", "xid": "48"}],
    ]
    _until(lambda: _groups(alertmanager, "StabmonTrainingStalled"), "the stall group")
    assert _groups(alertmanager, "StabmonTrainingStalled") == [
        [{"node": "n1", "rank": "0", "run": "r39"}, {"node": "n2", "rank": "1", "run": "r39"}]
    ]


def _inhibited(url: str, labels: dict[str, str]) -> bool:
    query = urllib.parse.urlencode(
        {"filter": [f'{k}="{v}"' for k, v in labels.items()]}, doseq=True
    )
    (alert,) = _get(f"{url}/api/v2/alerts?{query}")
    return bool(alert["status"]["inhibitedBy"])


def test_a_daemon_down_mutes_absent_ranks_of_its_own_node_only(alertmanager: str) -> None:
    down = {"alertname": "StabmonDaemonDown", "severity": "critical"}
    absent = {"alertname": "StabmonTrainingMetricsAbsent", "severity": "warning", "rank": "0"}
    _post(alertmanager, [
        # Kubernetes: targets carry node.
        {**down, "instance": "10.0.0.1:9399", "node": "n1"},
        {**absent, "run": "on-n1", "node": "n1"},
        {**absent, "run": "on-n2", "node": "n2"},
        # Compose or static configs: no node label anywhere.
        {**down, "instance": "hostb:9399"},
        {**absent, "run": "no-node"},
    ])  # fmt: skip
    _until(lambda: _inhibited(alertmanager, {"run": "on-n1"}), "the absent rank on n1 muted")
    assert not _inhibited(alertmanager, {"run": "on-n2"})
    assert not _inhibited(alertmanager, {"run": "no-node"})
