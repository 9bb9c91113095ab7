"""Processes a test starts end with it, whatever happens: process groups, a subreaper, and the
check at the end of a session that nothing was left behind (issue 43: a timed-out soak left
its ``stabmon daemon`` child running for a quarter of an hour).

- :func:`run_group` runs a command in a session of its own and, on every path (done,
  timed out, interrupted), kills what is left of its process group: a child's own children
  (a daemon it started, data loader workers) go with it.
- :func:`mark_owner` puts this process's pid in the environment every process a test starts
  inherits (:data:`OWNER`), so a grandchild whose parent was killed (re-parented to init) is
  still known as ours, without making pytest a subreaper (whose unreaped zombie orphans
  would show up as its children in the tests that look at them).
- :func:`stray_processes` lists the live processes that carry the mark: the session fixture
  in conftest fails the run on any, after killing them.
- :func:`time_scale` stretches subprocess timeouts with the machine's load: a timeout is a
  safety net against a hang, never a measure of speed, so a busy machine must not trip it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

import psutil

#: Children that outlive a test by design, owned by a library inside this process: the
#: inductor's compile workers (torch.compile) and multiprocessing's resource tracker.
_LIBRARY_CHILDREN = (
    "torch/_inductor/compile_worker",
    "torch._inductor.compile_worker",
    "multiprocessing.resource_tracker",
)
#: The variable that marks a process as started by this test process (not ``STABMON_*``: the
#: tests clear those).
OWNER = "TESTS_PROCESS_OWNER"


def time_scale() -> float:
    """How much longer than on an idle machine a subprocess may take: the 1-minute load per
    core (at least 1); ``STABMON_TEST_TIME_SCALE`` overrides it."""
    override = os.environ.get("STABMON_TEST_TIME_SCALE")
    if override:
        return max(1.0, float(override))
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def run_group(
    argv: Sequence[str], *, timeout: float, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True)`` in a session of its own, for
    at most ``timeout`` seconds times :func:`time_scale`; its whole process group is killed
    after, on every path. Raises ``subprocess.TimeoutExpired`` (with the output so far) past
    the timeout. The output goes through files, not pipes: a grandchild that inherited them
    cannot keep the call waiting after the command itself ended."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(
            list(argv), stdout=out, stderr=err, start_new_session=True, **kwargs
        )
        try:
            process.wait(timeout=timeout * time_scale())
        except BaseException as error:
            kill_group(process.pid)
            process.wait()
            if isinstance(error, subprocess.TimeoutExpired):
                error.stdout, error.stderr = _read(out), _read(err)
            raise
        finally:
            kill_group(process.pid)  # what the leader left behind in its group
        return subprocess.CompletedProcess(list(argv), process.returncode, _read(out), _read(err))


def _read(file: Any) -> str:
    file.seek(0)
    return str(file.read().decode("utf-8", "replace"))


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` (stopped ones too); none left is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGCONT)
        os.killpg(pgid, signal.SIGKILL)


def mark_owner() -> None:
    """Mark every process started from now on (through the environment) as this one's."""
    os.environ[OWNER] = str(os.getpid())


def stray_processes() -> list[psutil.Process]:
    """Live processes that carry this process's mark, but itself and the libraries' own."""
    mark = f"{OWNER}={os.getpid()}".encode()
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            with open(f"/proc/{process.pid}/environ", "rb") as environ:
                if mark not in environ.read().split(b"\0"):
                    continue
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(process.cmdline())
        except (OSError, psutil.Error):
            continue
        if any(owner in command for owner in _LIBRARY_CHILDREN):
            continue
        found.append(process)
    return found


def describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid}: {' '.join(process.cmdline())[:200]}"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"pid {process.pid}: (gone)"
