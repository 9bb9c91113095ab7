"""The real daemon, as a subprocess, watching real training processes (marked slow)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import has_nvidia_driver
from helpers import scrape_until as until
from helpers import start_announcing as start
from helpers import unique_value as get

pytestmark = pytest.mark.slow

TRAINEE = Path(__file__).with_name("trainee.py")


def test_daemon_reports_liveness_heartbeats_and_worker_memory_of_real_processes(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    run_dir = str(tmp_path)
    common = [sys.executable, str(TRAINEE), "--run-dir", run_dir, "--run-id", "job"]
    leaky, _ = start([*common, "--rank", "0", "--worker-mb-per-second", "20"])
    healthy, _ = start([*common, "--rank", "1"])
    processes += [leaky, healthy]
    daemon_args = ["daemon", "--port", "0", "--address", "127.0.0.1", "--run-dir", run_dir]
    daemon, url = start([sys.executable, "-m", "stabmon", *daemon_args, "--interval", "0.2"])
    processes.append(daemon)
    assert url.startswith("http://127.0.0.1:")

    samples = until(url, lambda s: get(s, "stabmon_process_up", rank="0", run="job") == 1
                     and get(s, "stabmon_process_up", rank="1", run="job") == 1)  # fmt: skip
    assert get(samples, "stabmon_process_up", rank="0", pid=str(leaky.pid)) == 1
    if not has_nvidia_driver():
        assert get(samples, "stabmon_daemon_nvml_up") == 0

    # The worker's steady allocation shows up in the workers' scope, not the main process's.
    samples = until(url, lambda s: (get(s, "stabmon_process_memory_bytes", rank="0",
                                          scope="workers") or 0) > 60 * 2**20)  # fmt: skip
    assert (get(samples, "stabmon_process_memory_bytes", rank="1", scope="workers") or 0) < 2**20
    assert get(samples, "stabmon_process_cpu_seconds_total", rank="0", scope="main") > 0

    # A frozen process: its heartbeat ages while the other's stays fresh.
    os.kill(healthy.pid, signal.SIGSTOP)
    samples = until(url, lambda s: (get(s, "stabmon_heartbeat_age_seconds", rank="1") or 0) > 2.0)
    assert get(samples, "stabmon_heartbeat_age_seconds", rank="0") < get(
        samples, "stabmon_heartbeat_age_seconds", rank="1"
    )

    # A killed process: down, while the other stays up.
    os.kill(healthy.pid, signal.SIGKILL)
    healthy.wait(10)
    samples = until(url, lambda s: get(s, "stabmon_process_up", rank="1", run="job") == 0)
    assert get(samples, "stabmon_process_up", rank="0", run="job") == 1

    # SIGTERM stops the daemon cleanly (how fast is bench's business, not a test's).
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(60) == 0
