"""From a fault in a real training process to a notification: Prometheus, Alertmanager, webhook.

Everything is real and on loopback: training processes (tests/integration/trainee.py), the
node daemon, Debian's Prometheus 2.42 with the shipped scrape config and rules, Debian's
Alertmanager 0.25 with the shipped routing tree and inhibitions
(deploy/alertmanager/alertmanager.yml), and a webhook receiver of this test's own. Faults
are injected for real: a NaN gradient, a run that stops stepping, a rank killed with
SIGKILL, a rank frozen with SIGSTOP, and one rank of a two-rank run sent SIGTERM (a warning,
not a crash). A clean run trains beside them throughout.

What differs from the deployed configuration, and why:
- Prometheus scrapes and evaluates every second (deployed: 15 s);
- the rules are the shipped file but for a shorter ``for:`` on the alerts awaited here
  (realstack.SHORTER_FOR: stall and process-down 15 s instead of 1m, the termination warning
  30 s instead of 2m), checked at start-up to differ in nothing else, so the shipped
  expressions, labels and annotations are what fire; the shipped durations are pinned by
  promtool on simulated time (deploy/prometheus/tests/stabmon.for.test.yml, and
  tests/integration/test_e2e_rules.py shows those tests fail with the shorter values);
- Alertmanager's receivers all post to the test's webhook (deployed: PagerDuty, Slack and a
  webhook), and its group_wait/group_interval are 1 s (deployed: 30 s and 5 m), so a
  notification, or a "resolved", arrives within seconds of Prometheus' decision.

Then the daemon is restarted while ``StabmonTrainingProcessDown`` (and the frozen rank's
stall) fire: neither may send "resolved". Times from each fault to its first notification
are printed (``pytest -s``). Marked slow: real processes, and it waits out each alert's
``for:`` (15 s, 30 s and the frozen rank's shipped 5 s) and the daemon restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from realstack import (
    Processes,
    Prometheus,
    announced,
    free_port,
    host_port,
    require,
    start_prometheus,
    until,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TRAINEE = Path(__file__).with_name("trainee.py")
ALERTMANAGER_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"


@dataclass
class Notification:
    received: float  # time.monotonic()
    received_unix: float
    receiver: str
    status: str  # of this alert: "firing" or "resolved"
    labels: dict[str, str]


@dataclass
class Webhook:
    """Alertmanager's webhook payloads, one entry per alert in them, as they arrive."""

    url: str = ""
    notifications: list[Notification] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, payload: dict[str, Any]) -> None:
        now, unix = time.monotonic(), time.time()
        with self.lock:
            for alert in payload["alerts"]:
                self.notifications.append(
                    Notification(now, unix, payload["receiver"], alert["status"], alert["labels"])
                )

    def seen(self, alertname: str, run: str, status: str = "firing") -> list[Notification]:
        with self.lock:
            return [
                n
                for n in self.notifications
                if n.labels.get("alertname") == alertname
                and n.labels.get("run") == run
                and n.status == status
            ]


def _serve_webhook() -> tuple[Webhook, ThreadingHTTPServer]:
    webhook = Webhook()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            length = int(self.headers.get("Content-Length", "0"))
            webhook.add(json.loads(self.rfile.read(length)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
    ).start()
    webhook.url = f"http://127.0.0.1:{server.server_address[1]}/alerts"
    return webhook, server


def _alertmanager_config(webhook_url: str) -> dict[str, Any]:
    """The shipped routing and inhibitions; every receiver posts to the test's webhook."""
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    config["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
    config["receivers"] = [
        {"name": receiver["name"],
         "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}
        for receiver in config["receivers"]
    ]  # fmt: skip
    return config


def _start_daemon(processes: Processes, run_dir: Path, port: int) -> subprocess.Popen[str]:
    daemon = processes.start([sys.executable, "-m", "stabmon", "daemon", "--port", str(port),
                              "--address", "127.0.0.1", "--run-dir", str(run_dir),
                              "--interval", "0.5"])  # fmt: skip
    announced(daemon)
    return daemon


@dataclass
class Stack:
    prometheus: Prometheus
    webhook: Webhook
    trainees: dict[str, subprocess.Popen[str]]
    processes: Processes
    run_dir: Path
    daemon_port: int
    daemon: subprocess.Popen[str]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require("prometheus")
    require("prometheus-alertmanager")
    work = tmp_path_factory.mktemp("alerting")
    run_dir = work / "runs"
    processes = Processes()
    webhook, server = _serve_webhook()
    try:
        trainee = [sys.executable, str(TRAINEE), "--run-dir", str(run_dir), "--rank", "0"]
        runs = {
            "clean": processes.start([*trainee, "--run-id", "clean"]),
            "nan": processes.start([*trainee, "--run-id", "nan", "--nan-on-sigusr1"]),
            "stall": processes.start(
                [*trainee, "--run-id", "stall", "--stop-at-step", "200", "--stall-seconds", "5"]
            ),
            "killed": processes.start([*trainee, "--run-id", "killed", "--stall-seconds", "5"]),
            "frozen": processes.start([*trainee, "--run-id", "frozen", "--stall-seconds", "5"]),
            # Two ranks of one run; rank 1 is sent SIGTERM (a preemption of one node).
            "preempt-0": processes.start([*trainee, "--run-id", "preempt"]),
            "preempt-1": processes.start(
                [
                    sys.executable,
                    str(TRAINEE),
                    "--run-dir",
                    str(run_dir),
                    "--rank",
                    "1",
                    "--run-id",
                    "preempt",
                ]
            ),  # fmt: skip
        }
        training = {host_port(announced(process)) for process in runs.values()}
        daemon_port = free_port()
        daemon = _start_daemon(processes, run_dir, daemon_port)
        daemon_target = f"127.0.0.1:{daemon_port}"
        alertmanager_port = free_port()
        config_path = work / "alertmanager.yml"
        config_path.write_text(yaml.safe_dump(_alertmanager_config(webhook.url)))
        processes.start(["prometheus-alertmanager", f"--config.file={config_path}",
                         f"--storage.path={work / 'alertmanager'}",
                         f"--web.listen-address=127.0.0.1:{alertmanager_port}",
                         "--cluster.listen-address=", "--log.level=warn"])  # fmt: skip
        prometheus = start_prometheus(
            processes, work, daemon_target, alertmanager=f"127.0.0.1:{alertmanager_port}"
        )
        prometheus.until(
            "every target scraped", lambda: prometheus.scraped() >= training | {daemon_target}, 90
        )
        yield Stack(prometheus, webhook, runs, processes, run_dir, daemon_port, daemon)
    finally:
        processes.close()
        server.shutdown()
        server.server_close()


def test_faults_reach_the_webhook_and_a_daemon_restart_resolves_nothing(stack: Stack) -> None:
    webhook, runs = stack.webhook, stack.trainees
    time.sleep(3)  # a few scrapes of every series before the faults
    injected = time.monotonic()
    runs["nan"].send_signal(signal.SIGUSR1)
    runs["killed"].send_signal(signal.SIGKILL)
    runs["frozen"].send_signal(signal.SIGSTOP)
    runs["preempt-1"].send_signal(signal.SIGTERM)
    # The "stall" run stopped stepping on its own after 200 steps (10 s at 20 steps/s).
    expected = [
        ("StabmonNonFiniteGradients", "nan"),
        ("StabmonTrainingStalled", "stall"),
        ("StabmonTrainingProcessDown", "killed"),
        ("StabmonTrainingStalled", "frozen"),
        ("StabmonTrainingProcessTerminated", "preempt"),
    ]
    try:
        stack.prometheus.until(
            "every fault notified",
            lambda: all(webhook.seen(alert, run) for alert, run in expected),
            240,
        )
        times = {
            f"{alert}(run={run})": min(n.received for n in webhook.seen(alert, run)) - injected
            for alert, run in expected
            if run != "stall"
        }
        # The "stall" run stopped by itself, before the others' faults: from its last step.
        (last_step,) = stack.prometheus.query('stabmon_last_step_timestamp_seconds{run="stall"}')
        first = min(n.received_unix for n in webhook.seen("StabmonTrainingStalled", "stall"))
        times["StabmonTrainingStalled(run=stall), from its last step"] = first - float(
            last_step["value"][1]
        )
        print("\nseconds from fault to first notification:", json.dumps(times, indent=1))
        assert {n.receiver for n in webhook.seen("StabmonTrainingProcessDown", "killed")} == {
            "pagerduty", "webhook", "slack"
        }  # fmt: skip
        # SIGTERM is a warning, to chat only, and no crash: it died by SIGTERM as it would have.
        terminated = webhook.seen("StabmonTrainingProcessTerminated", "preempt")
        assert {n.receiver for n in terminated} == {"webhook", "slack"}
        assert webhook.seen("StabmonTrainingProcessDown", "preempt") == []
        assert runs["preempt-1"].poll() == -signal.SIGTERM

        # The daemon restarts while ProcessDown and the frozen rank's stall fire.
        restarted = time.monotonic()
        stack.daemon.send_signal(signal.SIGTERM)
        stack.daemon.wait(10)
        time.sleep(8)  # several failed scrapes: every daemon series is marked stale
        _start_daemon(stack.processes, stack.run_dir, stack.daemon_port)
        daemon_target = f"127.0.0.1:{stack.daemon_port}"
        until("the daemon scraped again", lambda: daemon_target in stack.prometheus.scraped(), 60)
        time.sleep(15)  # time for a "resolved" to travel: 1 s evaluations, 1 s group_interval
        for alert, run in (("StabmonTrainingProcessDown", "killed"),
                           ("StabmonTrainingStalled", "frozen")):  # fmt: skip
            resolved = [n for n in webhook.seen(alert, run, "resolved") if n.received > restarted]
            assert resolved == [], f"{alert} of run {run} resolved across a daemon restart"
        print(f"daemon restart took {time.monotonic() - restarted:.0f} s; nothing resolved")

        # The clean run trained beside all of it and sent nothing.
        with webhook.lock:
            clean = [n for n in webhook.notifications if n.labels.get("run") == "clean"]
        assert clean == []
    finally:
        if runs["frozen"].poll() is None:
            os.kill(runs["frozen"].pid, signal.SIGCONT)  # so close() can end it
