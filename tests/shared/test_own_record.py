"""stabmon.shared.own_record: this process's record, written at attach, kept current by the
heartbeat, finished with how the process ended, removed at detach; read back the way the
node daemon reads it (stabmon.shared.rundir.read_records)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import MonitorFactory
from helpers import tiny_model, train_step

from stabmon.shared.rundir import read_records


def test_attached_process_registers_heartbeats_and_deregisters(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, sample_seconds=0.1, run_id="job-a")
    (record,), problems = read_records(tmp_path)
    assert not problems
    assert record.pid == psutil.Process().pid
    assert abs(record.create_time - psutil.Process().create_time()) < 0.01
    assert (record.run, record.rank, record.last_step_unix) == ("job-a", 0, None)
    assert record.metrics_url == monitor.metrics_url
    train_step(model, optimizer, monitor)
    deadline = time.monotonic() + 5
    while (record := read_records(tmp_path)[0][0]).steps == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # the heartbeat thread rewrites the record every 0.1 s
    assert record.steps == 1 and record.last_step_unix is not None
    monitor.detach()
    assert read_records(tmp_path) == ([], [])


_ENDINGS_SCRIPT = """
import os, sys
import torch, stabmon, stabmon.monitor
children = []
for run_dir, ending in zip(sys.argv[1::2], sys.argv[2::2]):
    pid = os.fork()
    if pid == 0:
        break
    children.append(pid)
else:  # the parent: waits for every child, and ends without a word
    for pid in children:
        os.waitpid(pid, 0)
    os._exit(0)
model = torch.nn.Linear(2, 1)
mon = stabmon.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), port=0,
                     run_dir=run_dir, run_id="job")
if ending == "raise":
    raise RuntimeError("the training loop failed")
if ending == "detach":
    mon.detach()
if ending.startswith("exit "):
    code = ending[len("exit "):]
    sys.exit(int(code) if code.isdigit() else code)  # a code, or a message (exit status 1)
"""
_ENDINGS = {
    "raise": "exception",
    "return": "clean",
    "detach": None,
    "exit 1": "exception",  # sys.exit(1): a failed run, whatever its scheduler is told
    "exit 0": "clean",
    "exit the loop gave up": "exception",
}


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The run directory of each ending, once every child has ended."""
    run_dirs = {ending: tmp_path_factory.mktemp("ended") for ending in _ENDINGS}
    arguments = []
    for ending, run_dir in run_dirs.items():
        arguments += [str(run_dir), ending]
    # A session of its own: on a timeout, the forked children are killed with the parent.
    parent = subprocess.Popen([sys.executable, "-c", _ENDINGS_SCRIPT, *arguments],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)  # fmt: skip
    try:
        _, stderr = parent.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # none left: every child ended
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)
    assert parent.returncode == 0, stderr.decode(errors="replace")[-3000:]
    return run_dirs


@pytest.mark.slow  # real processes exiting: make test runs them
@pytest.mark.parametrize(("ending", "expected"), _ENDINGS.items())
def test_record_tells_a_crash_from_a_clean_end(
    ended: dict[str, Path], ending: str, expected: str | None
) -> None:
    records, problems = read_records(ended[ending])
    assert not problems
    if expected is None:
        assert records == []  # detached: deregistered
    else:
        (record,) = records
        assert record.exit_status == expected and record.exited_unix is not None
