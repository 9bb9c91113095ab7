"""Real processes killed mid-run: a training process, and the node daemon (marked slow).

Reuses the daemon-subprocess helpers of tests/integration/test_daemon_processes.py
(``_start``, ``_until``, ``_get`` and the ``processes`` fixture, which kills
every process group it was given). Checkpoint-and-resume after a SIGKILL is
proved in tests/integration/test_resume.py; here the trainee of
tests/integration/trainee.py is killed and restarted under the same run id
and rank while the daemon watches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import events, scrape, value
from helpers import scrape_until as until
from helpers import start_announcing as start
from helpers import unique_value as get

pytestmark = pytest.mark.slow

_INTEGRATION = Path(__file__).parents[1] / "integration"
TRAINEE = _INTEGRATION / "trainee.py"


def _trainee(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, str(TRAINEE), "--run-dir", str(run_dir), "--run-id", "job",
            "--rank", "0", "--steps-per-second", "50", *extra]  # fmt: skip


def _daemon(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "stabmon", "daemon", "--port", "0", "--address", "127.0.0.1",
            "--run-dir", str(run_dir), "--interval", "0.2"]  # fmt: skip


def _steps(url: str) -> float:
    return value(scrape(url), "stabmon_steps_total") or 0.0


def _wait_steps(url: str, at_least: float, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while (steps := _steps(url)) < at_least:
        assert time.monotonic() < deadline, f"only {steps} steps within {timeout} s"
        time.sleep(0.1)
    return steps


def test_trainee_killed_mid_run_and_restarted_leaves_whole_records_and_the_daemon_follows(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    daemon, daemon_url = start(_daemon(tmp_path))
    first, first_url = start(_trainee(tmp_path, "--nan-at-step", "5"))
    processes += [daemon, first]
    until(daemon_url, lambda s: get(s, "stabmon_process_up", pid=str(first.pid)) == 1)
    _wait_steps(first_url, 40)  # mid-run: past the NaN, between epoch records

    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    until(daemon_url, lambda s: get(s, "stabmon_process_up", pid=str(first.pid)) == 0)

    second, second_url = start(_trainee(tmp_path))
    processes.append(second)
    samples = until(daemon_url, lambda s: get(s, "stabmon_process_up", pid=str(second.pid)) == 1)
    up = [v for (n, labels), v in samples.items() if n == "stabmon_process_up"]
    assert up == [1.0]  # the rank's record now names the new process only
    assert _wait_steps(second_url, 5) >= 5  # the new process's own counters start from 0

    log_path = tmp_path / "job" / "rank-0.events.jsonl"
    raw = log_path.read_bytes()
    assert raw.endswith(b"\n")
    records = events(log_path)  # every line strict JSON: nothing torn by the kill
    attaches = [r["pid"] for r in records if r["event"] == "attach"]
    assert attaches == [first.pid, second.pid]  # the restart appended to the same log
    second_attach = next(i for i, r in enumerate(records) if r.get("pid") == second.pid)
    nan = [
        (i < second_attach, r["step"])
        for i, r in enumerate(records)
        if r["event"] == "anomaly" and r["kind"] == "nonfinite_grad"
    ]
    assert nan == [(True, 5)]  # the killed process's anomaly, kept; none from the new one
    assert not [r for r in records if r["event"] == "detach"]  # neither process detached


def test_daemon_killed_and_restarted_leaves_training_running_and_finds_it_again(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    trainee, trainee_url = start(_trainee(tmp_path))
    first, first_url = start(_daemon(tmp_path))
    processes += [trainee, first]
    until(first_url, lambda s: get(s, "stabmon_process_up", pid=str(trainee.pid)) == 1)

    os.killpg(first.pid, signal.SIGKILL)
    first.wait(10)
    before = _steps(trainee_url)
    after = _wait_steps(trainee_url, before + 20)  # training never noticed
    assert trainee.poll() is None and after > before

    second, second_url = start(_daemon(tmp_path))
    processes.append(second)
    samples = until(
        second_url,
        lambda s: (
            get(s, "stabmon_process_up", pid=str(trainee.pid)) == 1
            and (get(s, "stabmon_heartbeat_age_seconds", rank="0") or 99) < 5
        ),
    )
    assert get(samples, "stabmon_process_up", rank="0", run="job") == 1
