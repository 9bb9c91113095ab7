"""stabmon.wiring.registration: this process's record in the run directory, written for real in
tmp_path and read back with stabmon.shared.rundir's own reader; a duplicate holder is a real
live process. CUDA cannot exist here: the LOCAL_RANK check stands in torch.cuda's two
answers (is_available, device_count)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stabmon.config import load_config
from stabmon.export.event_log import EventLog
from stabmon.pipeline.readings import Readings
from stabmon.pipeline.recorder import Recorder
from stabmon.probes.placement import Misplaced
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter
from stabmon.shared.own_record import ExitWatch
from stabmon.shared.rundir import ProcessRecord, RunPaths, boot_id, read_records
from stabmon.wiring.registration import check_local_rank, register, report_misplaced
from stabmon.wiring.resources import Resources


@pytest.fixture
def held() -> Iterator[Resources]:
    resources = Resources()
    yield resources
    resources.close()


def _register(held: Resources, paths: RunPaths, guard: Guard) -> None:
    register(
        held,
        paths,
        run_id=paths.run_id,
        local_rank=0,
        devices=[],
        metrics_url="http://127.0.0.1:9400/metrics",
        stall_seconds=300.0,
        steps=7,
        guard=guard,
        limiter=LogLimiter(),
    )


def _recorder() -> tuple[Recorder, Readings]:
    readings = Readings(labels={})
    recorder = Recorder(load_config({}, env={}), readings, events=None, limiter=LogLimiter())
    return recorder, readings


def test_register_writes_a_record_the_daemon_can_read(tmp_path: Path, held: Resources) -> None:
    paths = RunPaths(root=tmp_path, run_id="job", rank=3)
    _register(held, paths, Guard(LogLimiter()))
    (record,), problems = read_records(tmp_path)
    assert problems == []
    assert (record.pid, record.run, record.rank, record.steps) == (os.getpid(), "job", 3, 7)
    assert record.metrics_url == "http://127.0.0.1:9400/metrics"
    assert record.stall_seconds == 300.0
    assert record.boot_id == boot_id()
    assert record.exit_status is None


def test_the_exit_hook_says_how_the_process_ended(tmp_path: Path, held: Resources) -> None:
    paths = RunPaths(root=tmp_path, run_id="job", rank=0)
    _register(held, paths, Guard(LogLimiter()))
    assert held.at_exit is not None
    held.at_exit()  # what atexit runs at interpreter exit
    (record,), _ = read_records(tmp_path)
    assert record.exit_status == ExitWatch.status()
    assert record.exited_unix is not None


def test_detach_removes_the_record(tmp_path: Path) -> None:
    held = Resources()
    paths = RunPaths(root=tmp_path, run_id="job", rank=0)
    _register(held, paths, Guard(LogLimiter()))
    held.close()
    assert read_records(tmp_path)[0] == []


def test_a_live_process_holding_the_same_run_and_rank_is_reported_and_counted(
    tmp_path: Path, held: Resources, caplog: pytest.LogCaptureFixture
) -> None:
    paths = RunPaths(root=tmp_path, run_id="job", rank=0)
    paths.run_directory.mkdir(parents=True)
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        holder = ProcessRecord(pid=other.pid, create_time=0.0, run="job", rank=0)
        paths.record.write_bytes(holder.to_json())
        guard = Guard(LogLimiter())
        with caplog.at_level(logging.WARNING, logger="stabmon"):
            _register(held, paths, guard)
    finally:
        other.communicate(b"")
    assert guard.counts["rundir"] == 1
    assert f"process {other.pid} already registered run 'job' rank 0" in caplog.text
    (record,), _ = read_records(tmp_path)
    assert record.pid == os.getpid()  # taken over


def test_a_record_of_a_process_that_is_gone_is_no_duplicate(
    tmp_path: Path, held: Resources
) -> None:
    paths = RunPaths(root=tmp_path, run_id="job", rank=0)
    paths.run_directory.mkdir(parents=True)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    paths.record.write_bytes(
        ProcessRecord(pid=int(gone.stdout), create_time=0.0, run="job", rank=0).to_json()
    )
    guard = Guard(LogLimiter())
    _register(held, paths, guard)
    assert guard.counts.get("rundir", 0) == 0


def test_an_unwritable_run_directory_is_contained_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    held = Resources()
    guard = Guard(LogLimiter())
    _register(held, RunPaths(root=blocker, run_id="job", rank=0), guard)  # a file, not a dir
    held.close()
    assert guard.counts["rundir"] == 1


def test_check_local_rank_reports_a_rank_with_no_device_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    recorder, readings = _recorder()
    check_local_rank(recorder, Guard(LogLimiter()))
    assert readings.anomalies["device_mismatch"] == 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    check_local_rank(recorder, Guard(LogLimiter()))
    assert readings.anomalies["device_mismatch"] == 1


def test_check_local_rank_does_nothing_without_cuda() -> None:
    recorder, readings = _recorder()
    check_local_rank(recorder, Guard(LogLimiter()))
    assert readings.anomalies["device_mismatch"] == 0


def test_report_misplaced_is_a_device_mismatch_anomaly_at_the_current_step(
    tmp_path: Path,
) -> None:
    readings = Readings(labels={})
    path = tmp_path / "rank-0.events.jsonl"
    events = EventLog(path, common={}, guard=Guard(LogLimiter()))
    recorder = Recorder(load_config({}, env={}), readings, events=events, limiter=LogLimiter())
    readings.steps = 12
    report_misplaced(recorder, Misplaced("optimizer state", "cpu", "cuda:0", ("w",)))
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert (record["kind"], record["step"], record["what"], record["expected"]) == (
        "device_mismatch",
        12,
        "optimizer state",
        "cuda:0",
    )
    assert "device_check: raise makes this an error" in record["detail"]
