"""Processes a test starts end with it, whatever happens: process groups, a subreaper, and the
check at the end of a session that nothing was left behind (issue 43: a timed-out soak left
its ``stabmon daemon`` child running for a quarter of an hour).

- :func:`run_group` runs a command in a session of its own and, on every path (done,
  timed out, interrupted), kills what is left of its process group: a child's own children
  (a daemon it started, data loader workers) go with it.
- :func:`become_subreaper` makes this process the one orphans are re-parented to (Linux's
  ``PR_SET_CHILD_SUBREAPER``), so a grandchild whose parent was killed is still ours to see.
- :func:`stray_processes` lists what remains below this process: the session fixture in
  conftest fails the run on any, after killing them.
- :func:`time_scale` stretches subprocess timeouts with the machine's load: a timeout is a
  safety net against a hang, never a measure of speed, so a busy machine must not trip it.
"""

from __future__ import annotations

import contextlib
import ctypes
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
_PR_SET_CHILD_SUBREAPER = 36


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


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process (Linux); False elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def stray_processes(keep: Sequence[int] = ()) -> list[psutil.Process]:
    """Live processes below this one, but ``keep`` and the libraries' own (reaps zombies)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child.pid, os.WNOHANG)
                continue
            command = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if child.pid in keep or any(owner in command for owner in _LIBRARY_CHILDREN):
            continue
        found.append(child)
    return found


def describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid}: {' '.join(process.cmdline())[:200]}"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"pid {process.pid}: (gone)"
