"""SIGTERM ends an attached process exactly as before (killed by SIGTERM), and its record says
so: the daemon then warns of a termination instead of paging a crash. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from stabmon.shared.rundir import read_records
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]

# Attaches, says "ready", then waits in Python (the handler path) or in one long C call that
# never looks at signals (the thread path: a hung collective), or forks a child first.
_TRAINEE = """
import hashlib, os, sys, time
import torch, stabmon
model = torch.nn.Linear(2, 1)
monitor = stabmon.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), port=0,
                         address="127.0.0.1", run_dir=sys.argv[1], run_id="job",
                         sample_seconds=0.1)
mode = sys.argv[2]
if mode == "fork":
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print("child", child, flush=True)
print("ready", flush=True)
if mode == "c-call":
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 10**9)  # minutes in C, no signal checks
else:
    time.sleep(60)
print("still alive", flush=True)
"""


def _start(run_dir: Path, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", _TRAINEE, str(run_dir), mode], env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip


def _end(process: subprocess.Popen[str]) -> None:
    process.kill()
    process.wait(10)
    if process.stdout is not None:
        process.stdout.close()


def _wait_ready(process: subprocess.Popen[str]) -> list[str]:
    assert process.stdout is not None
    lines = []
    while (line := process.stdout.readline().strip()) != "ready":
        assert line, f"the trainee exited before it was ready (code {process.poll()})"
        lines.append(line)
    return lines


@pytest.mark.parametrize("mode", ["python", "c-call"])
def test_sigterm_still_kills_the_process_and_its_record_says_signal(
    tmp_path: Path, mode: str
) -> None:
    process = _start(tmp_path, mode)
    try:
        _wait_ready(process)
        time.sleep(0.3)  # into the sleep, or the C call
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == -signal.SIGTERM  # killed by SIGTERM, as without stabmon
    finally:
        _end(process)
    (record,), _ = read_records(tmp_path)
    assert (record.exit_status, record.exit_signal) == ("signal", "SIGTERM")


def test_sigterm_to_a_forked_worker_ends_the_worker_not_the_parent(tmp_path: Path) -> None:
    process = _start(tmp_path, "fork")
    try:
        (line,) = _wait_ready(process)
        child = int(line.split()[1])
        os.kill(child, signal.SIGTERM)
        # The worker dies of it (a zombie until its parent reaps it), SIGTERM unblocked.
        wait_until(lambda: psutil.Process(child).status() == psutil.STATUS_ZOMBIE,
                   "the worker to die of SIGTERM", timeout=60)  # fmt: skip
        time.sleep(0.5)  # a parent dying of it would die now; the assertion is on its state
        assert process.poll() is None, "the parent died of its worker's SIGTERM"
        (record,), _ = read_records(tmp_path)
        assert record.exit_status is None
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == -signal.SIGTERM
    finally:
        _end(process)


def test_a_handler_someone_installed_first_is_left_alone(tmp_path: Path) -> None:
    code = _TRAINEE.replace(
        "import torch, stabmon",
        "import signal, torch, stabmon\nsignal.signal(signal.SIGTERM, lambda s, f: sys.exit(3))",
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), "python"], env=env,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait_ready(process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 3  # the user's handler ran, as without stabmon
    finally:
        _end(process)
