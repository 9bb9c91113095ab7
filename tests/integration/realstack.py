"""Real processes and a real Prometheus for the integration tests: start, announce, scrape, stop.

``Processes`` starts each child in its own session and kills the whole group at the
end, so a failing test leaves nothing behind; ``start_prometheus`` runs Debian's
Prometheus with the project's scrape config pointed at a local daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "stabmon.rules.yml"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"

#: The ``for:`` the end-to-end tests give the rules they wait for, by (alert, n-th rule of that
#: name). Everything else in their rules file is the shipped file's, byte for byte, and
#: tests/integration/test_e2e_rules.py proves that promtool's tests of the shipped file fail
#: with any of these values, so the shipped durations are pinned on simulated time.
SHORTER_FOR = {
    ("StabmonTrainingStalled", 0): "15s",  # shipped: 1m (the in-process legs)
    ("StabmonTrainingProcessDown", 0): "15s",  # shipped: 1m
    ("StabmonTrainingProcessTerminated", 0): "30s",  # shipped: 2m
}


def rules_with_for(changes: dict[tuple[str, int], str], text: str | None = None) -> str:
    """The shipped rules file's text with only the ``for:`` of the named rules replaced.

    A rule is named by its alert and its index among the rules of that alert name. The
    text is edited line by line, so comments, expressions, labels and annotations are
    the shipped ones, unparsed and unformatted.
    """
    lines = (RULES.read_text() if text is None else text).splitlines(keepends=True)
    seen: dict[str, int] = {}
    current: tuple[str, int] | None = None
    done = set()
    for number, line in enumerate(lines):
        alert = re.match(r"\s*- alert: (\S+)\s*$", line)
        if alert:
            name = alert.group(1)
            current = (name, seen.get(name, 0))
            seen[name] = current[1] + 1
        elif re.match(r"\s*- (record|name):", line):
            current = None
        duration = re.match(r"(\s*for: )\S+(\s*)$", line)
        if duration and current in changes:
            lines[number] = f"{duration.group(1)}{changes[current]}{duration.group(2)}"
            done.add(current)
    missing = set(changes) - done
    assert not missing, f"no such rule with a for: in the rules file: {sorted(missing)}"
    return "".join(lines)


def differences_besides_for(shipped: str, copy: str) -> list[str]:
    """Where two rules files differ in anything but ``for:`` values (empty: only in ``for:``)."""

    def without_for(text: str) -> Any:
        document = yaml.safe_load(text)
        for group in document["groups"]:
            for rule in group["rules"]:
                rule.pop("for", None)
        return document

    differences = []
    if without_for(shipped) != without_for(copy):
        differences.append("the parsed rules differ in more than for:")
    duration = re.compile(r"(\s*for: )[0-9]+[smhdwy]$")
    for old, new in zip(shipped.splitlines(), copy.splitlines(), strict=False):
        was, now = duration.match(old), duration.match(new)
        if old != new and not (was and now and was.group(1) == now.group(1)):
            differences.append(f"{old!r} -> {new!r}")
    if len(shipped.splitlines()) != len(copy.splitlines()):
        differences.append("a different number of lines")
    return differences


#: Ports picked for a process a test starts later: below Linux's ephemeral range
#: (32768-60999 by default), so no socket that binds port 0 or connects (gloo, a TCPStore,
#: a scrape) can take one in the seconds before its process binds it.
_CHOSEN_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port that is free now and that the kernel will not hand out to another socket."""
    for _ in range(200):
        port = random.choice(_CHOSEN_PORTS)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {_CHOSEN_PORTS}")


def announced(process: subprocess.Popen[str]) -> str:
    """The URL a child prints as the last word of its first line (``ready <url>``)."""
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line, f"process exited before announcing its URL (code {process.poll()})"
    return line.rsplit(" ", 1)[1]


def host_port(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


def until(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


class Processes:
    """Children started for one test or module, killed (whole process groups) at close."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def start(
        self, args: Sequence[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            list(args), stdout=subprocess.PIPE, text=True, start_new_session=True, env=env
        )
        self.started.append(process)
        return process

    def close(self) -> None:
        """Kill every child and everything it started, wherever it went.

        torchrun starts its workers in sessions of their own, so killing its process
        group would leave them behind: descendants are collected first and killed by pid.
        """
        for process in self.started:
            if process.poll() is None:
                try:
                    descendants = psutil.Process(process.pid).children(recursive=True)
                except psutil.Error:
                    descendants = []
                for child in descendants:
                    with contextlib.suppress(psutil.Error):
                        child.kill()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
            if process.stdout is not None:
                process.stdout.close()


class Prometheus:
    """A running Prometheus and its HTTP API."""

    def __init__(self, base: str) -> None:
        self.base = base

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.base}{path}?{query}", timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result = self.get("/api/v1/query", query=expr)
        return result["result"] if isinstance(result, dict) else []

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/alerts")["alerts"])

    def scraped(self) -> set[str]:
        """``host:port`` of every target whose last scrape succeeded."""
        try:
            active = self.get("/api/v1/targets")["activeTargets"]
        except OSError:
            return set()
        return {t["labels"]["instance"] for t in active if t["health"] == "up"}

    def until(self, what: str, check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:.0f} s; alerts: {self.alerts()}")
            time.sleep(1.0)


def require(tool: str) -> None:
    """Skip without ``tool`` on a developer machine; fail in CI, which must run the test."""
    if shutil.which(tool) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is not installed; CI must run this test (make tools)")
        pytest.skip(f"Requires: {tool} (apt-get install prometheus)")


def start_prometheus(
    processes: Processes, work: Path, daemon_target: str, alertmanager: str | None = None
) -> Prometheus:
    """Prometheus with the deployed scrape config and rules, pointed at one local daemon.

    Only the intervals (1 s) and the daemon's address differ from the deployed config;
    the training ranks are found as deployed, through the daemon's ``/targets``. With
    ``alertmanager`` (``host:port``), alerts go there; without, they are only in the API.
    The rules are the shipped file with the ``for:`` of the alerts these tests wait for
    shortened (``SHORTER_FOR``), checked here to differ in nothing else.
    """
    rules = work / "rules"
    rules.mkdir()
    shipped = RULES.read_text()
    shortened = rules_with_for(SHORTER_FOR, shipped)
    assert differences_besides_for(shipped, shortened) == []
    assert shortened != shipped
    (rules / RULES.name).write_text(shortened)
    text = SCRAPE_CONFIG.read_text().replace("host.docker.internal:9399", daemon_target)
    config = yaml.safe_load(text)
    config["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    config["rule_files"] = [str(rules / "*.rules.yml")]
    if alertmanager is None:
        config.pop("alerting", None)  # no Alertmanager here; alerts are read from the API
    else:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    for job in config["scrape_configs"]:
        for sd in job.get("http_sd_configs", []):
            sd["refresh_interval"] = "1s"
    config_path = work / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    processes.start(["prometheus", f"--config.file={config_path}",
                     f"--storage.tsdb.path={work / 'tsdb'}",
                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"])  # fmt: skip
    return Prometheus(f"http://127.0.0.1:{port}")
