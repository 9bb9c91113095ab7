"""The process hygiene of the suite itself (tests/process_groups.py): a command's whole group
ends with it on every path, and an orphan is still found at the session's end."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
from process_groups import kill_group, run_group, stray_processes, time_scale

#: Starts a grandchild in the same group that would outlive its parent, prints its pid.
_LEAVES_A_CHILD = (
    "import subprocess, sys; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
    "print(child.pid, flush=True)"
)


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_finished_command_leaves_nothing_of_its_group_behind() -> None:
    done = run_group([sys.executable, "-c", _LEAVES_A_CHILD], timeout=60)
    assert done.returncode == 0
    assert _gone(int(done.stdout.split()[0]))


def test_a_timed_out_command_is_killed_with_its_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STABMON_TEST_TIME_SCALE", "1")
    script = _LEAVES_A_CHILD + "; import time; time.sleep(300)"
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        run_group([sys.executable, "-c", script], timeout=3)
    text = str(timed_out.value.stdout or "")
    assert text.split() and _gone(int(text.split()[0]))


def test_an_orphan_whose_parent_was_killed_is_found_as_a_stray() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _LEAVES_A_CHILD + "; import time; "
                               "time.sleep(300)"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    assert parent.stdout is not None
    orphan = int(parent.stdout.readline())
    parent.kill()  # as a timeout kills a soak, leaving its daemon behind
    parent.wait()
    parent.stdout.close()
    try:
        assert orphan in [process.pid for process in stray_processes()]
    finally:
        kill_group(parent.pid)
    assert _gone(orphan) and orphan not in [process.pid for process in stray_processes()]


def test_timeouts_stretch_with_the_load_and_never_shrink(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STABMON_TEST_TIME_SCALE", "0.5")
    assert time_scale() == 1.0
    monkeypatch.setenv("STABMON_TEST_TIME_SCALE", "4")
    assert time_scale() == 4.0
