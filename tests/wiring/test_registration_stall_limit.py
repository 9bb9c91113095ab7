"""The heartbeat writes each rank's current stall limit and phase into its record, so the
node daemon can judge a rank too frozen to run its own watchdog."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from conftest import MonitorFactory
from helpers import tiny_model, train_step

from stabmon.shared.rundir import ProcessRecord, read_records


def _record_after(tmp_path: Path, condition: object) -> ProcessRecord:
    deadline = time.monotonic() + 5
    while True:
        records, _ = read_records(tmp_path)
        if records and callable(condition) and condition(records[0]):
            return records[0]
        assert time.monotonic() < deadline, f"record never satisfied the condition: {records}"
        time.sleep(0.05)  # the heartbeat thread rewrites the record every 0.1 s


def test_heartbeat_records_the_startup_limit_then_the_step_limit(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, sample_seconds=0.1, stall_seconds=7.0,
                     phase_stall_seconds=900.0)  # fmt: skip
    # Before the first step the watchdog allows phase_stall_seconds (compilation, first batches).
    record = _record_after(tmp_path, lambda r: r.stall_limit_seconds is not None)
    assert (record.phase, record.stall_limit_seconds) == ("startup", 900.0)
    train_step(model, optimizer, monitor)
    record = _record_after(tmp_path, lambda r: r.steps >= 1 and r.stall_limit_seconds == 7.0)
    assert record.phase not in (None, "startup")


def test_heartbeat_records_the_phase_limit_inside_a_named_phase(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, sample_seconds=0.1, stall_seconds=7.0,
                     phase_stall_seconds=900.0)  # fmt: skip
    train_step(model, optimizer, monitor)
    with monitor.phase("eval"):
        record = _record_after(tmp_path, lambda r: r.phase == "eval")
        assert record.stall_limit_seconds == 900.0
