"""A real Prometheus, with the project's scrape config and rules, scraping real training runs.

Three training processes and the daemon run for real: a clean run (with a CPU
GradScaler, so the AMP series exist), a run with one injected NaN, and a run
that stops stepping. Prometheus (Debian's 2.42) scrapes them every second and
evaluates the shipped rules every second. It finds the training ranks the way
the deployed config does, through the daemon's ``/targets`` service discovery;
only the intervals and the daemon's address differ from the deployed config.
Marked slow: it waits for the stall alert's ``for: 1m``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from stabmon import contract

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TRAINEE = Path(__file__).with_name("trainee.py")
RULES = ROOT / "deploy" / "prometheus" / "rules" / "stabmon.rules.yml"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARDS = ROOT / "dashboards" / "json"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _announced(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line, f"process exited before announcing its URL (code {process.poll()})"
    return line.rsplit(" ", 1)[1]


def _host_port(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


class Prometheus:
    """A running Prometheus and its HTTP API."""

    def __init__(self, base: str, trainees: dict[str, subprocess.Popen[str]]) -> None:
        self.base = base
        self.trainees = trainees

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

    def until(self, what: str, check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:.0f} s; alerts: {self.alerts()}")
            time.sleep(1.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    if shutil.which("prometheus") is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed; CI must run this test (make tools)")
        pytest.skip("Requires: prometheus (apt-get install prometheus)")
    work = tmp_path_factory.mktemp("e2e")
    run_dir = work / "runs"
    started: list[subprocess.Popen[str]] = []

    def start(args: list[str]) -> subprocess.Popen[str]:
        process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
        started.append(process)
        return process

    try:
        trainee = [sys.executable, str(TRAINEE), "--run-dir", str(run_dir), "--rank", "0"]
        runs = {
            "clean": start([*trainee, "--run-id", "clean", "--amp"]),
            "nan": start([*trainee, "--run-id", "nan", "--nan-on-sigusr1"]),
            "stall": start(
                [*trainee, "--run-id", "stall", "--stop-at-step", "40", "--stall-seconds", "2"]
            ),  # fmt: skip
        }
        training = {_host_port(_announced(process)) for process in runs.values()}
        daemon = start([sys.executable, "-m", "stabmon", "daemon", "--port", "0", "--address",
                        "127.0.0.1", "--run-dir", str(run_dir), "--interval", "0.5"])  # fmt: skip
        daemon_target = _host_port(_announced(daemon))

        rules = work / "rules"
        rules.mkdir()
        shutil.copy(RULES, rules / RULES.name)
        # The deployed config, pointed at this daemon: the daemon's /targets lists the ranks.
        text = SCRAPE_CONFIG.read_text().replace("host.docker.internal:9399", daemon_target)
        config = yaml.safe_load(text)
        config["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
        config["rule_files"] = [str(rules / "*.rules.yml")]
        config.pop("alerting", None)  # no Alertmanager here; alerts are read from the API
        for job in config["scrape_configs"]:
            for sd in job.get("http_sd_configs", []):
                sd["refresh_interval"] = "1s"
        config_path = work / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))

        port = _free_port()
        start(["prometheus", f"--config.file={config_path}", f"--storage.tsdb.path={work / 'tsdb'}",
               f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"])  # fmt: skip
        prometheus = Prometheus(f"http://127.0.0.1:{port}", runs)

        def all_up() -> bool:
            try:
                active = prometheus.get("/api/v1/targets")["activeTargets"]
            except OSError:
                return False
            scraped = {t["labels"]["instance"] for t in active if t["health"] == "up"}
            return scraped == training | {daemon_target}

        prometheus.until("every target scraped", all_up, timeout=60)
        yield prometheus
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
            if process.stdout is not None:
                process.stdout.close()


def test_every_training_metric_of_the_contract_is_ingested(stack: Prometheus) -> None:
    cuda_only = {
        contract.DEVICE_MEMORY_ALLOCATED.name,
        contract.DEVICE_MEMORY_RESERVED.name,
        contract.DEVICE_MEMORY_PEAK.name,
    }
    time.sleep(3)  # a few scrapes after the first
    missing = []
    for metric in contract.TRAINING_METRICS:
        if metric.name in cuda_only:
            continue  # no CUDA on this machine
        name = f"{metric.name}_count" if metric.type == "histogram" else metric.name
        if not stack.query(f'count({{__name__="{name}"}})'):
            missing.append(name)
    assert not missing


def test_every_dashboard_expression_parses_and_the_trainings_return_data(stack: Prometheus) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate", ROOT / "dashboards" / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    # Series that cannot exist on this machine: GPUs (no driver), CUDA allocator and events.
    hardware = re.compile(r"stabmon_(gpu_|process_gpu_|device_memory_|device_phase|device_step|"
                          r"device_utilization)")  # fmt: skip
    empty = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for expr in generate.expressions(json.loads(path.read_text())):
            concrete = _instantiate(expr)
            result = stack.query(concrete)  # a PromQL error fails here, in Prometheus's parser
            if not result and not hardware.search(expr) and not _FILTER.search(expr):
                empty.append(f"{path.name}: {concrete}")
    assert not empty


def test_nan_run_makes_the_non_finite_gradient_alert_pending_or_firing(stack: Prometheus) -> None:
    def nan_alert() -> bool:
        return any(a["labels"].get("alertname") == "StabmonNonFiniteGradients"
                   and a["labels"].get("run") == "nan" for a in stack.alerts())  # fmt: skip

    # Inject the NaN only now that Prometheus has scraped the run's counter at zero.
    assert not nan_alert()
    os.kill(stack.trainees["nan"].pid, signal.SIGUSR1)
    stack.until("StabmonNonFiniteGradients for run nan", nan_alert, timeout=60)


def test_run_that_stops_stepping_fires_the_stall_alert(stack: Prometheus) -> None:
    def stall_firing() -> bool:
        return any(a["labels"].get("alertname") == "StabmonTrainingStalled"
                   and a["labels"].get("run") == "stall" and a["state"] == "firing"
                   for a in stack.alerts())  # fmt: skip

    stack.until("StabmonTrainingStalled firing for run stall", stall_firing, timeout=150)


def test_clean_run_fires_nothing(stack: Prometheus) -> None:
    time.sleep(2)  # runs last in this module: the stack has been up for minutes by now
    about_clean = [a for a in stack.alerts() if a["labels"].get("run") == "clean"]
    assert about_clean == []


#: A trailing comparison filter ("> 0", "== 1"): empty is a correct answer, so parse-only.
_FILTER = re.compile(r"(==|!=|>=|<=|>|<)\s*-?[\d.]+\s*$")


def _instantiate(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced the way Grafana would."""
    replacements = {
        "$__rate_interval": "1m",
        "$__interval": "15s",
        "$__range": "1h",
        "${__rate_interval}": "1m",
    }
    for variable, value in replacements.items():
        expr = expr.replace(variable, value)
    # Template variables in label matchers ("$run", "${run:regex}") select everything.
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*(:[a-z]+)?\}?", ".*", expr)
