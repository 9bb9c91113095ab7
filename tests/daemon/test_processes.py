"""ProcessTable and ProcessCollector against real processes started by the tests."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import value
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stabmon.daemon.processes import ProcessCollector, ProcessSample, ProcessTable
from stabmon.shared.log import LogLimiter
from stabmon.shared.rundir import MAX_RECORD_BYTES, ProcessRecord, RunPaths, boot_id, write_atomic

# Prepended to every child: it exits once its parent is gone, so a killed test run (or a worker
# whose parent the test killed) never leaves an orphan behind, however long it would sleep.
ORPHAN_GUARD = """
import os as _os, threading as _threading, time as _time
def _exit_when_orphaned(parent=_os.getppid()):
    while _os.getppid() == parent:
        _time.sleep(0.05)
    _os._exit(1)
_threading.Thread(target=_exit_when_orphaned, daemon=True).start()
"""
SLEEPER = ORPHAN_GUARD + "import time; print('ready', flush=True); time.sleep(60)"
BURNER = (
    ORPHAN_GUARD
    + """
import sys, time
print('ready', flush=True)
sys.stdin.readline()
start = time.process_time()
while time.process_time() - start < 0.4:
    pass
print('burnt', flush=True)
time.sleep(60)
"""
)
# A training process with one data loader worker running argv[1]; "stop" on stdin ends the worker.
PARENT = (
    ORPHAN_GUARD
    + """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, text=True)
print(worker.stdout.readline().strip(), flush=True)
sys.stdin.readline()
worker.kill()
worker.wait()
print('reaped', flush=True)
time.sleep(60)
"""
)
HOARDING_WORKER = ORPHAN_GUARD + (
    "import time; hoard = b'x' * (50 << 20); print('ready', flush=True); time.sleep(60)"
)
SLEEPING_WORKER = SLEEPER
BURNING_WORKER = (
    ORPHAN_GUARD
    + """
import time
start = time.process_time()
while time.process_time() - start < 0.3:
    pass
print('burnt', flush=True)
time.sleep(60)
"""
)

Spawn = Callable[..., "subprocess.Popen[str]"]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """``spawn(code, *args)``: a Python child in its own process group, killed with it after."""
    started: list[subprocess.Popen[str]] = []

    def start(code: str, *args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        # Only an unreaped child still owns its group id; a reaped one's pid may be reused.
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the group: workers die with their parent
        process.communicate(timeout=10)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs"


def _line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"child exited early with code {process.poll()}"
    return line.strip()


def _send(process: subprocess.Popen[str], text: str) -> None:
    assert process.stdin is not None
    process.stdin.write(text + "\n")
    process.stdin.flush()


def _register(
    run_dir: Path,
    pid: int,
    *,
    rank: int = 0,
    create_time: float | None = None,
    path: Path | None = None,
    **fields: Any,
) -> Path:
    """Write a record for ``pid`` (rank ``rank`` of run "job"), last written now unless told."""
    created = psutil.Process(pid).create_time() if create_time is None else create_time
    fields.setdefault("updated_unix", time.time())
    record = ProcessRecord(pid=pid, create_time=created, run="job", rank=rank, **fields)
    path = RunPaths(run_dir, "job", rank).record if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, record.to_json())
    return path


def _table(
    run_dir: Path,
    *,
    clock: Callable[[], float] = time.time,
    forget_after_seconds: float = 3600.0,
    boot_id: str = "this-boot",
) -> ProcessTable:
    return ProcessTable(
        run_dir,
        limiter=LogLimiter(),
        clock=clock,
        forget_after_seconds=forget_after_seconds,
        boot_id=lambda: boot_id,
    )


def _dead_pid(spawn: Spawn) -> int:
    child = spawn("pass")
    child.wait(10)
    return child.pid


def _only(samples: list[ProcessSample]) -> ProcessSample:
    assert len(samples) == 1, samples
    return samples[0]


def _scrape(table: ProcessTable) -> Samples:
    registry = CollectorRegistry()
    registry.register(ProcessCollector(table))
    samples: Samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def _kill(process: subprocess.Popen[str]) -> None:
    process.kill()
    process.wait(10)


def test_process_table_reports_a_live_registered_process_up(run_dir: Path, spawn: Spawn) -> None:
    child = spawn(SLEEPER)
    _line(child)
    _register(run_dir, child.pid)
    table = _table(run_dir)
    sample = _only(table.poll())
    assert sample.alive and not sample.reused
    assert value(_scrape(table), "stabmon_process_up", rank="0", run="job", pid=str(child.pid)) == 1


def test_process_table_measures_the_main_process_memory(run_dir: Path, spawn: Spawn) -> None:
    child = spawn(SLEEPER)
    _line(child)
    _register(run_dir, child.pid)
    sample = _only(_table(run_dir).poll())
    assert sample.main_memory_bytes is not None and sample.main_memory_bytes > 0
    assert sample.workers_memory_bytes == 0


def test_process_table_cpu_seconds_grow_while_the_process_burns_cpu(
    run_dir: Path, spawn: Spawn
) -> None:
    child = spawn(BURNER)
    _line(child)
    _register(run_dir, child.pid)
    table = _table(run_dir)
    before = _only(table.poll()).main_cpu_seconds
    _send(child, "go")
    assert _line(child) == "burnt"
    after = _only(table.poll()).main_cpu_seconds
    assert before is not None and after is not None
    assert after - before >= 0.3


def test_process_table_counts_a_worker_memory_in_the_workers_scope(
    run_dir: Path, spawn: Spawn
) -> None:
    parent = spawn(PARENT, HOARDING_WORKER)
    assert _line(parent) == "ready"
    _register(run_dir, parent.pid)
    sample = _only(_table(run_dir).poll())
    assert sample.workers_memory_bytes is not None and sample.main_memory_bytes is not None
    assert sample.workers_memory_bytes >= 50 * 2**20
    assert sample.main_memory_bytes < 50 * 2**20


def test_process_table_workers_cpu_never_decreases_when_a_worker_exits(
    run_dir: Path, spawn: Spawn
) -> None:
    parent = spawn(PARENT, BURNING_WORKER)
    assert _line(parent) == "burnt"
    _register(run_dir, parent.pid)
    table = _table(run_dir)
    with_worker = _only(table.poll())
    _send(parent, "stop")
    assert _line(parent) == "reaped"
    without_worker = _only(table.poll())
    assert with_worker.workers_cpu_seconds is not None
    assert with_worker.workers_cpu_seconds >= 0.25
    assert without_worker.workers_cpu_seconds is not None
    assert without_worker.workers_cpu_seconds >= with_worker.workers_cpu_seconds
    assert without_worker.workers_memory_bytes == 0


def test_process_table_reports_a_killed_process_down(run_dir: Path, spawn: Spawn) -> None:
    child = spawn(SLEEPER)
    _line(child)
    _register(run_dir, child.pid)
    table = _table(run_dir)
    table.poll()
    _kill(child)
    sample = _only(table.poll())
    assert not sample.alive and not sample.reused
    assert value(_scrape(table), "stabmon_process_up", pid=str(child.pid)) == 0


def test_process_table_reports_an_unreaped_zombie_down(run_dir: Path, spawn: Spawn) -> None:
    child = spawn(SLEEPER)
    _line(child)
    _register(run_dir, child.pid)
    os.kill(child.pid, signal.SIGKILL)  # not waited for: a zombie until the fixture reaps it
    deadline = time.monotonic() + 5
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the killed child never became a zombie"
        time.sleep(0.01)
    sample = _only(_table(run_dir).poll())
    assert not sample.alive and not sample.reused


def test_process_table_flags_a_reused_pid_as_not_alive(run_dir: Path) -> None:
    own_start = psutil.Process().create_time()
    _register(run_dir, os.getpid(), create_time=own_start - 100.0)
    sample = _only(_table(run_dir).poll())
    assert sample.reused and not sample.alive
    assert sample.main_cpu_seconds is None and sample.main_memory_bytes is None


def test_process_table_accepts_a_create_time_within_its_tolerance(run_dir: Path) -> None:
    _register(run_dir, os.getpid(), create_time=psutil.Process().create_time() + 0.3)
    assert _only(_table(run_dir).poll()).alive


def test_process_table_reports_heartbeat_age_from_its_clock(run_dir: Path) -> None:
    _register(run_dir, os.getpid(), last_step_unix=1000.0)
    sample = _only(_table(run_dir, clock=lambda: 1012.5).poll())
    assert sample.heartbeat_age_seconds == 12.5


def test_process_table_reports_no_heartbeat_age_before_the_first_step(run_dir: Path) -> None:
    _register(run_dir, os.getpid())
    table = _table(run_dir)
    assert _only(table.poll()).heartbeat_age_seconds is None
    assert value(_scrape(table), "stabmon_heartbeat_age_seconds") is None


def test_process_collector_keeps_exporting_the_heartbeat_age_of_a_dead_process(
    run_dir: Path, spawn: Spawn
) -> None:
    child = spawn(SLEEPER)
    _line(child)
    _register(run_dir, child.pid, last_step_unix=1000.0, updated_unix=1000.0)
    _kill(child)
    table = _table(run_dir, clock=lambda: 1090.0)
    table.poll()
    samples = _scrape(table)
    assert value(samples, "stabmon_heartbeat_age_seconds", rank="0", run="job") == 90.0
    assert value(samples, "stabmon_process_memory_bytes", scope="main") is None
    assert value(samples, "stabmon_process_cpu_seconds_total", scope="main") is None


def test_process_collector_exports_cpu_and_memory_of_both_scopes(
    run_dir: Path, spawn: Spawn
) -> None:
    child = spawn(SLEEPER)
    _line(child)
    _register(run_dir, child.pid)
    table = _table(run_dir)
    table.poll()
    samples = _scrape(table)
    for scope in ("main", "workers"):
        labels = {"rank": "0", "run": "job", "scope": scope}
        assert value(samples, "stabmon_process_cpu_seconds_total", **labels) is not None
        assert value(samples, "stabmon_process_memory_bytes", **labels) is not None
    assert (value(samples, "stabmon_process_memory_bytes", scope="main") or 0) > 0


def test_process_table_forgets_a_record_dead_longer_than_forget_after_seconds(
    run_dir: Path, spawn: Spawn
) -> None:
    _register(run_dir, _dead_pid(spawn), create_time=1.0, updated_unix=5000.0)
    now = [5000.0]
    table = _table(run_dir, clock=lambda: now[0], forget_after_seconds=3600.0)
    assert not _only(table.poll()).alive
    now[0] += 3599.0
    assert not _only(table.poll()).alive
    now[0] += 2.0
    assert table.poll() == []
    assert value(_scrape(table), "stabmon_process_up") is None


def test_process_table_drops_a_record_whose_file_was_removed(run_dir: Path, spawn: Spawn) -> None:
    child = spawn(SLEEPER)
    _line(child)
    path = _register(run_dir, child.pid)
    table = _table(run_dir)
    assert _only(table.poll()).alive
    path.unlink()
    assert table.poll() == []
    assert table.samples() == []


def test_process_table_skips_and_logs_each_unusable_record_once(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stabmon")
    good = _register(run_dir, os.getpid(), rank=9)
    text = good.read_bytes()
    wrong_types = json.loads(text)
    wrong_types["pid"] = "1234"
    bad = {
        run_dir / "job" / "rank-0.json": b"{this is not json",
        run_dir / "job" / "rank-1.json": text[: len(text) // 2],
        run_dir / "job" / "rank-2.json": json.dumps(wrong_types).encode(),
        run_dir / "job" / "rank-3.json": text + b" " * MAX_RECORD_BYTES,
    }
    for path, content in bad.items():
        path.write_bytes(content)
    directory = run_dir / "other" / "rank-0.json"
    directory.mkdir(parents=True)
    table = _table(run_dir)
    for _ in range(3):
        assert [s.record.rank for s in table.poll()] == [9]
    for path in [*bad, directory]:
        logged = [r for r in caplog.records if str(path) in r.getMessage()]
        assert len(logged) == 1, (path, [r.getMessage() for r in caplog.records])


def test_process_table_returns_nothing_and_logs_once_when_the_run_dir_disappears(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stabmon")
    _register(run_dir, os.getpid())
    table = _table(run_dir)
    assert len(table.poll()) == 1
    shutil.rmtree(run_dir)
    assert table.poll() == []
    assert table.poll() == []
    assert table.samples() == []
    assert len([r for r in caplog.records if "disappeared" in r.getMessage()]) == 1


def test_process_table_follows_nothing_before_the_run_dir_exists(run_dir: Path) -> None:
    table = _table(run_dir)
    assert table.poll() == []
    _register(run_dir, os.getpid())
    assert len(table.poll()) == 1


def test_process_table_skips_an_old_dead_record_even_when_it_starts_fresh(
    run_dir: Path, spawn: Spawn
) -> None:
    _register(run_dir, _dead_pid(spawn), create_time=1.0, updated_unix=1000.0)
    fresh = _table(run_dir, clock=lambda: 1000.0 + 3601.0, forget_after_seconds=3600.0)
    assert fresh.poll() == []
    assert value(_scrape(fresh), "stabmon_process_up") is None


def test_process_table_reports_a_recently_dead_record_down_when_it_starts_fresh(
    run_dir: Path, spawn: Spawn
) -> None:
    pid = _dead_pid(spawn)
    _register(run_dir, pid, create_time=1.0, updated_unix=1000.0)
    fresh = _table(run_dir, clock=lambda: 1000.0 + 3599.0, forget_after_seconds=3600.0)
    assert not _only(fresh.poll()).alive
    assert value(_scrape(fresh), "stabmon_process_up", pid=str(pid)) == 0


def test_process_table_keeps_following_a_live_process_whose_record_is_old(run_dir: Path) -> None:
    _register(run_dir, os.getpid(), updated_unix=1.0)
    assert _only(_table(run_dir, forget_after_seconds=60.0).poll()).alive


def test_process_table_counts_an_exit_record_as_written_when_forgetting(
    run_dir: Path, spawn: Spawn
) -> None:
    _register(run_dir, _dead_pid(spawn), create_time=1.0, updated_unix=1000.0,
              exited_unix=4000.0, exit_status="exception")  # fmt: skip
    assert len(_table(run_dir, clock=lambda: 5000.0, forget_after_seconds=3600.0).poll()) == 1


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"hostname": "other-node", "boot_id": "other-nodes-boot"}, "other-node"),
        ({"hostname": "this-node", "boot_id": "an-earlier-boot"}, "an-earlier-boot"),
    ],
)
def test_process_table_skips_and_logs_once_a_record_that_is_not_this_nodes(
    run_dir: Path, caplog: pytest.LogCaptureFixture, fields: dict[str, str], reason: str
) -> None:
    caplog.set_level(logging.INFO, logger="stabmon")
    path = _register(run_dir, os.getpid(), **fields)
    table = _table(run_dir, boot_id="this-boot")
    for _ in range(3):
        assert table.poll() == []
    assert value(_scrape(table), "stabmon_process_up") is None
    logged = [r for r in caplog.records if str(path) in r.getMessage()]
    assert len(logged) == 1
    assert logged[0].levelno == logging.INFO and reason in logged[0].getMessage()


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"hostname": "this-node", "boot_id": "this-boot"},
        {"hostname": "a-training-pod", "boot_id": "this-boot"},  # containers: own hostnames
        {"boot_id": "this-boot"},
    ],
)
def test_process_table_follows_a_record_of_this_node_or_one_that_does_not_say(
    run_dir: Path, fields: dict[str, str]
) -> None:
    _register(run_dir, os.getpid(), **fields)
    assert _only(_table(run_dir, boot_id="this-boot").poll()).alive


def test_process_table_compares_nothing_when_the_node_cannot_say_who_it_is(run_dir: Path) -> None:
    _register(run_dir, os.getpid(), hostname="node-a", boot_id="boot-a")
    assert _only(_table(run_dir, boot_id="").poll()).alive


def test_process_table_defaults_to_this_boots_id(run_dir: Path) -> None:
    _register(run_dir, os.getpid(), hostname=socket.gethostname(), boot_id=boot_id())
    assert _only(ProcessTable(run_dir, limiter=LogLimiter()).poll()).alive
    _register(run_dir, os.getpid(), boot_id=boot_id() + "-before-a-reboot")
    assert ProcessTable(run_dir, limiter=LogLimiter()).poll() == []


def test_process_table_does_not_export_a_run_that_exited_cleanly(
    run_dir: Path, spawn: Spawn
) -> None:
    _register(run_dir, _dead_pid(spawn), create_time=1.0, exited_unix=time.time(),
              exit_status="clean")  # fmt: skip
    table = _table(run_dir)
    assert table.poll() == []
    assert value(_scrape(table), "stabmon_process_up") is None


def test_process_table_reports_a_run_that_ended_by_an_exception_down_with_its_age(
    run_dir: Path,
) -> None:
    # Its own pid: a process that recorded an exception is down even while atexit still runs.
    _register(run_dir, os.getpid(), last_step_unix=1000.0, updated_unix=1000.0,
              exited_unix=1001.0, exit_status="exception")  # fmt: skip
    table = _table(run_dir, clock=lambda: 1030.0)
    sample = _only(table.poll())
    assert not sample.alive and not sample.reused
    samples = _scrape(table)
    assert value(samples, "stabmon_process_up", pid=str(os.getpid())) == 0
    assert value(samples, "stabmon_heartbeat_age_seconds", rank="0", run="job") == 30.0


def test_process_table_reports_a_vanished_process_without_exit_status_down(
    run_dir: Path, spawn: Spawn
) -> None:
    pid = _dead_pid(spawn)
    _register(run_dir, pid, create_time=1.0)
    table = _table(run_dir)
    assert not _only(table.poll()).alive
    assert value(_scrape(table), "stabmon_process_up", pid=str(pid)) == 0


def test_process_table_ages_the_heartbeat_from_attach_before_the_first_step(
    run_dir: Path,
) -> None:
    _register(run_dir, os.getpid(), attached_unix=1000.0)
    table = _table(run_dir, clock=lambda: 1030.0)
    assert _only(table.poll()).heartbeat_age_seconds == 30.0
    assert value(_scrape(table), "stabmon_heartbeat_age_seconds", rank="0", run="job") == 30.0


def test_process_table_ages_the_heartbeat_from_the_last_step_once_there_is_one(
    run_dir: Path,
) -> None:
    _register(run_dir, os.getpid(), attached_unix=900.0, last_step_unix=1000.0)
    assert _only(_table(run_dir, clock=lambda: 1030.0).poll()).heartbeat_age_seconds == 30.0


def test_process_table_warns_once_per_process_when_pss_falls_back_to_rss(
    run_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="stabmon")

    def denied(self: psutil.Process) -> Any:
        raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil.Process, "memory_full_info", denied)
    _register(run_dir, os.getpid())
    table = _table(run_dir)
    for _ in range(3):
        memory = _only(table.poll()).main_memory_bytes
        assert memory is not None and memory > 0  # the RSS
    logged = [r for r in caplog.records if "PSS" in r.getMessage()]
    # This pytest process may have children of its own (another test's subprocess, a compile
    # worker), which the table reads as workers and warns about too: once each, like the main.
    pids = [r.getMessage().split("PSS of process ")[1].split()[0] for r in logged]
    assert sorted(pids) == sorted(set(pids)), "a process was warned about more than once"
    own = [r for r, pid in zip(logged, pids, strict=True) if pid == str(os.getpid())]
    assert len(own) == 1
    assert own[0].levelno == logging.WARNING
    assert "main process" in own[0].getMessage() and "CAP_SYS_PTRACE" in own[0].getMessage()


def test_process_table_lists_the_worker_pids_of_a_process(run_dir: Path, spawn: Spawn) -> None:
    parent = spawn(PARENT, SLEEPING_WORKER)
    assert _line(parent) == "ready"
    _register(run_dir, parent.pid)
    [worker] = psutil.Process(parent.pid).children()
    table = _table(run_dir)
    assert _only(table.poll()).worker_pids == (worker.pid,)
    _send(parent, "stop")
    assert _line(parent) == "reaped"
    assert _only(table.poll()).worker_pids == ()


def test_process_table_ignores_a_record_outside_its_runs_directory_and_logs_it_once(
    run_dir: Path, spawn: Spawn, caplog: pytest.LogCaptureFixture
) -> None:
    # A run's records live in its own directory (trust by owner, issue 40): a second record
    # for rank 0 of "job" elsewhere is never followed, so there is no duplicate to choose.
    caplog.set_level(logging.INFO, logger="stabmon")
    dead = _dead_pid(spawn)
    _register(run_dir, dead, create_time=1.0, path=run_dir / "job-old" / "rank-0.json")
    _register(run_dir, os.getpid())
    table = _table(run_dir)
    for _ in range(3):
        sample = _only(table.poll())
        assert sample.alive and sample.record.pid == os.getpid()
    assert value(_scrape(table), "stabmon_process_up", pid=str(dead)) is None
    logged = [r for r in caplog.records if "job-old" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert "ignored: it names run 'job'" in logged[0].getMessage()


def test_process_table_follows_the_record_in_the_runs_directory_not_an_older_one_elsewhere(
    run_dir: Path, spawn: Spawn
) -> None:
    older, newer = _dead_pid(spawn), _dead_pid(spawn)
    _register(run_dir, newer, create_time=1.0, updated_unix=1000.0)
    _register(run_dir, older, create_time=1.0, updated_unix=2000.0,
              path=run_dir / "job-old" / "rank-0.json")  # fmt: skip
    sample = _only(_table(run_dir, clock=lambda: 2100.0).poll())
    assert sample.record.pid == newer and not sample.alive


def test_spawned_workers_exit_when_their_parent_is_killed(spawn: Spawn) -> None:
    parent = spawn(PARENT, SLEEPING_WORKER)
    assert _line(parent) == "ready"
    [worker] = psutil.Process(parent.pid).children()
    os.kill(parent.pid, signal.SIGKILL)  # the parent only: the worker must notice by itself
    parent.wait(10)
    worker.wait(timeout=10)  # raises TimeoutExpired while the worker lives on
    assert not worker.is_running()
