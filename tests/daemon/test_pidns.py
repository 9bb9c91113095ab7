"""Training processes in a PID namespace of their own (a container), followed by the daemon."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from stabmon.daemon.pidns import HostPids
from stabmon.daemon.processes import ProcessTable
from stabmon.shared.log import LogLimiter
from stabmon.shared.rundir import ProcessRecord, pid_namespace, read_records

TRAINEE = Path(__file__).resolve().parents[1] / "integration" / "trainee.py"
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*UNSHARE, "true"], capture_output=True, check=False).returncode == 0


def _fake_proc(root: Path, processes: dict[int, tuple[str, str]]) -> Path:
    """A /proc with ``pid -> (namespace, NSpid line)``; ``self`` is in the host namespace."""
    for pid, (namespace, nspid) in {**processes, 1: ("pid:[1]", "1")}.items():
        (root / str(pid) / "ns").mkdir(parents=True)
        os.symlink(namespace, root / str(pid) / "ns" / "pid")
        (root / str(pid) / "status").write_text(f"Name:\tpython\nNSpid:\t{nspid}\n")
    os.symlink("1", root / "self")
    return root


def _record(pid: int, namespace: str) -> ProcessRecord:
    return ProcessRecord(pid=pid, create_time=5.0, run="job", rank=0, pid_namespace=namespace)


def test_host_pids_maps_a_container_pid_through_nspid(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {4242: ("pid:[77]", "4242\t1"), 4300: ("pid:[88]", "4300\t1")})
    pids = HostPids(limiter=LogLimiter(), proc=proc)
    records = [_record(1, "pid:[77]"), _record(1, "pid:[88]"), _record(9, "pid:[1]")]
    pids.new_poll(records)
    assert [pids.resolve(record) for record in records] == [4242, 4300, 9]
    assert pids.resolve(_record(1, "")) == 1  # a record from before namespaces were recorded


def test_host_pids_answers_none_for_a_namespace_no_process_here_has(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pids = HostPids(limiter=LogLimiter(), proc=_fake_proc(tmp_path, {}))
    record = _record(1, "pid:[99]")
    pids.new_poll([record])
    assert pids.resolve(record) is None
    assert "hostPID: true" in caplog.text


@pytest.fixture
def contained(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    if not _can_unshare():
        pytest.skip("Requires: permission to create PID namespaces (unshare --pid)")
    run_dir = tmp_path / "runs"
    process = subprocess.Popen(
        [*UNSHARE, sys.executable, str(TRAINEE), "--run-dir", str(run_dir), "--run-id", "boxed",
         "--rank", "0"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None and process.stdout.readline().startswith("ready")
        yield process, run_dir
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        assert process.stdout is not None
        process.stdout.close()


@pytest.mark.slow
@pytest.mark.parametrize("links", ["readable", "unreadable"])
def test_daemon_follows_a_process_in_its_own_pid_namespace_by_its_host_pid(
    contained: tuple[subprocess.Popen[str], Path], links: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if links == "unreadable":  # a daemon without ptrace access to other users' processes
        from stabmon.daemon import pidns

        real = pidns.pid_namespace
        monkeypatch.setattr(
            pidns,
            "pid_namespace",
            lambda pid="self", proc=Path("/proc"): real(pid, proc) if pid == "self" else "",
        )
    unshare, run_dir = contained
    (trainee,) = psutil.Process(unshare.pid).children()  # the trainee, as this namespace sees it
    records, _ = read_records(run_dir)
    (record,) = records
    assert record.pid != trainee.pid  # it registered the pid its own namespace gave it
    assert record.pid_namespace and record.pid_namespace != pid_namespace()

    table = ProcessTable(run_dir, limiter=LogLimiter())
    (sample,) = table.poll()
    assert sample.alive
    assert sample.record.pid == trainee.pid  # exported and placed by the pid this node uses
    assert sample.main_memory_bytes is not None and sample.main_memory_bytes > 0

    trainee.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while table.poll()[0].alive and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not table.poll()[0].alive


def test_two_processes_matching_an_unreadable_namespace_are_ambiguous_not_a_guess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stabmon.daemon import pidns

    # Two pods of one job: the same in-container pid, links unreadable, the same start tick.
    proc = _fake_proc(tmp_path, {5001: ("pid:[1]", "5001\t7"), 5002: ("pid:[1]", "5002\t7")})
    monkeypatch.setattr(pidns, "pid_namespace", lambda pid="self", proc=proc: (
        "pid:[1]" if pid == "self" else ""))  # fmt: skip
    monkeypatch.setattr(pidns, "_started_at", lambda pid, create_time: True)
    pids = HostPids(limiter=LogLimiter(), proc=proc)
    record = _record(7, "pid:[4026532999]")
    pids.new_poll([record])
    assert pids.resolve(record) is pidns.AMBIGUOUS
    monkeypatch.setattr(pidns, "_started_at", lambda pid, create_time: pid == 5002)
    pids.new_poll([record])
    assert pids.resolve(record) == 5002
