"""The real daemon, as a subprocess, watching real training processes (marked slow)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import has_nvidia_driver, scrape

pytestmark = pytest.mark.slow

TRAINEE = Path(__file__).with_name("trainee.py")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Start a process that prints one line announcing its URL; return it and the URL."""
    # A session of its own: the fixture kills the whole group, workers included.
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line, f"{args[1:3]} exited before announcing itself (code {process.poll()})"
    return process, line.rsplit(" ", 1)[1]


def _get(samples: Samples, name: str, **labels: str) -> float | None:
    found = [v for (n, lbl), v in samples.items() if n == name and set(labels.items()) <= lbl]
    return found[0] if len(found) == 1 else None


def _until(url: str, predicate: Callable[[Samples], bool], timeout: float = 15.0) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if predicate(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s; last scrape: {samples}")
        time.sleep(0.2)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGCONT)
            os.killpg(process.pid, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the leader is gone; its workers too
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def test_daemon_reports_liveness_heartbeats_and_worker_memory_of_real_processes(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    run_dir = str(tmp_path)
    common = [sys.executable, str(TRAINEE), "--run-dir", run_dir, "--run-id", "job"]
    leaky, _ = _start([*common, "--rank", "0", "--worker-mb-per-second", "20"])
    healthy, _ = _start([*common, "--rank", "1"])
    processes += [leaky, healthy]
    daemon_args = ["daemon", "--port", "0", "--address", "127.0.0.1", "--run-dir", run_dir]
    daemon, url = _start([sys.executable, "-m", "stabmon", *daemon_args, "--interval", "0.2"])
    processes.append(daemon)
    assert url.startswith("http://127.0.0.1:")

    samples = _until(url, lambda s: _get(s, "stabmon_process_up", rank="0", run="job") == 1
                     and _get(s, "stabmon_process_up", rank="1", run="job") == 1)  # fmt: skip
    assert _get(samples, "stabmon_process_up", rank="0", pid=str(leaky.pid)) == 1
    if not has_nvidia_driver():
        assert _get(samples, "stabmon_daemon_nvml_up") == 0

    # The worker's steady allocation shows up in the workers' scope, not the main process's.
    samples = _until(url, lambda s: (_get(s, "stabmon_process_memory_bytes", rank="0",
                                          scope="workers") or 0) > 60 * 2**20)  # fmt: skip
    assert (_get(samples, "stabmon_process_memory_bytes", rank="1", scope="workers") or 0) < 2**20
    assert _get(samples, "stabmon_process_cpu_seconds_total", rank="0", scope="main") > 0

    # A frozen process: its heartbeat ages while the other's stays fresh.
    os.kill(healthy.pid, signal.SIGSTOP)
    samples = _until(url, lambda s: (_get(s, "stabmon_heartbeat_age_seconds", rank="1") or 0) > 2.0)
    assert _get(samples, "stabmon_heartbeat_age_seconds", rank="0") < 1.5

    # A killed process: down, while the other stays up.
    os.kill(healthy.pid, signal.SIGKILL)
    healthy.wait(10)
    samples = _until(url, lambda s: _get(s, "stabmon_process_up", rank="1", run="job") == 0)
    assert _get(samples, "stabmon_process_up", rank="0", run="job") == 1

    # SIGTERM stops the daemon cleanly within a second or so.
    started = time.monotonic()
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(5) == 0
    assert time.monotonic() - started < 2.5
