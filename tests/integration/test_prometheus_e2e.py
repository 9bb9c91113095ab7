"""A real Prometheus, with the project's scrape config and rules, scraping real training runs.

Three training processes and the daemon run for real: a clean run (with a CPU
GradScaler, so the AMP series exist), a run with one injected NaN, and a run
that stops stepping. Prometheus (Debian's 2.42) scrapes them every second and
evaluates the shipped rules every second. It finds the training ranks the way
the deployed config does, through the daemon's ``/targets`` service discovery;
only the intervals and the daemon's address differ from the deployed config, and
the rules' ``for:`` on the alerts the tests wait for (realstack.SHORTER_FOR: the
stall's 1m is 15 s here; checked to be the only change, and the shipped duration
is pinned by promtool, see tests/integration/test_e2e_rules.py).
Marked slow: real processes, and it waits out the stall alert's ``for:``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from realstack import Processes, Prometheus, announced, host_port, require, start_prometheus

from stabmon import contract

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TRAINEE = Path(__file__).with_name("trainee.py")
DASHBOARDS = ROOT / "dashboards" / "json"


@dataclass
class Stack:
    prometheus: Prometheus
    trainees: dict[str, subprocess.Popen[str]]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require("prometheus")
    work = tmp_path_factory.mktemp("e2e")
    run_dir = work / "runs"
    processes = Processes()
    try:
        trainee = [sys.executable, str(TRAINEE), "--run-dir", str(run_dir), "--rank", "0"]
        runs = {
            "clean": processes.start([*trainee, "--run-id", "clean", "--amp"]),
            "nan": processes.start([*trainee, "--run-id", "nan", "--nan-on-sigusr1"]),
            "stall": processes.start(
                [*trainee, "--run-id", "stall", "--stop-at-step", "40", "--stall-seconds", "2"]
            ),  # fmt: skip
        }
        training = {host_port(announced(process)) for process in runs.values()}
        daemon = processes.start([sys.executable, "-m", "stabmon", "daemon", "--port", "0",
                                  "--address", "127.0.0.1", "--run-dir", str(run_dir),
                                  "--interval", "0.5"])  # fmt: skip
        daemon_target = host_port(announced(daemon))
        prometheus = start_prometheus(processes, work, daemon_target)
        prometheus.until(
            "every target scraped", lambda: prometheus.scraped() == training | {daemon_target}, 60
        )
        yield Stack(prometheus, runs)
    finally:
        processes.close()


def test_every_training_metric_of_the_contract_is_ingested(stack: Stack) -> None:
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
        if not stack.prometheus.query(f'count({{__name__="{name}"}})'):
            missing.append(name)
    assert not missing


def test_every_dashboard_expression_parses_and_the_trainings_return_data(stack: Stack) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate", ROOT / "dashboards" / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    # Series that cannot exist on this machine: GPUs (no driver), CUDA allocator and events,
    # MFU (a CUDA device's peak FLOP/s); and the slowdown baseline, set after the detector's
    # warm-up and first judged block, which these short runs do not reach.
    hardware = re.compile(r"stabmon_(gpu_|process_gpu_|device_memory_|device_phase|device_step|"
                          r"device_utilization|mfu_ratio|peak_flops|"
                          r"step_time_baseline)")  # fmt: skip
    # Series the rules record in groups of their own interval (1 min; stabmon.aggregates,
    # stabmon.forecasts, stabmon.throughput): these short runs may end before their first
    # evaluation, and the forecasts and straggler ratios need an hour or two ranks a run.
    recorded = re.compile(r"\b[a-z_]+:stabmon_\w+:\w+")
    empty = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for expr in generate.expressions(json.loads(path.read_text())):
            concrete = _instantiate(expr)
            result = stack.prometheus.query(
                concrete
            )  # a PromQL error fails here, in Prometheus's parser
            if not result and not hardware.search(expr) and not _FILTER.search(expr) \
                    and not recorded.search(expr):  # fmt: skip
                empty.append(f"{path.name}: {concrete}")
    assert not empty


def test_nan_run_makes_the_non_finite_gradient_alert_pending_or_firing(stack: Stack) -> None:
    def nan_alert() -> bool:
        alerts = stack.prometheus.alerts()
        return any(a["labels"].get("alertname") == "StabmonNonFiniteGradients"
                   and a["labels"].get("run") == "nan" for a in alerts)  # fmt: skip

    # Inject the NaN only now that Prometheus has scraped the run's counter at zero.
    assert not nan_alert()
    os.kill(stack.trainees["nan"].pid, signal.SIGUSR1)
    stack.prometheus.until("StabmonNonFiniteGradients for run nan", nan_alert, timeout=60)


def test_run_that_stops_stepping_fires_the_stall_alert(stack: Stack) -> None:
    def stall_firing() -> bool:
        return any(a["labels"].get("alertname") == "StabmonTrainingStalled"
                   and a["labels"].get("run") == "stall" and a["state"] == "firing"
                   for a in stack.prometheus.alerts())  # fmt: skip

    stack.prometheus.until("StabmonTrainingStalled firing for run stall", stall_firing, timeout=150)


def test_clean_run_fires_nothing(stack: Stack) -> None:
    time.sleep(2)  # runs last in this module: the stack has been up for minutes by now
    about_clean = [a for a in stack.prometheus.alerts() if a["labels"].get("run") == "clean"]
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
