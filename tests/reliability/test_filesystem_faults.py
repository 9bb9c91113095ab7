"""A run directory on a full or read-only file system: training goes on, one log line, a counter.

A real file system, not a mock: a 64 KiB tmpfs mounted for the test (needs
root and ``mount``; skipped with the reason otherwise). The event log on
``/dev/full`` (no root needed) is in tests/export/test_event_log.py.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import MonitorFactory
from helpers import tiny_model, train_step

import stabmon


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs at a fresh mount point, unmounted after the test."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k,mode=1777", "tmpfs", str(mount_point)],
            check=True, capture_output=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"Requires: root and mount to make a small tmpfs ({error})")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False, timeout=20)


def _fill(root: Path) -> None:
    """Write until the file system says it is full."""
    with contextlib.suppress(OSError), (root / "filler").open("wb", buffering=0) as filler:
        for _ in range(1_000):
            filler.write(b"\0" * 4096)


def _errors(monitor: stabmon.Monitor) -> dict[str, float]:
    return {
        sample.labels["component"]: sample.value
        for family in monitor.registry.collect()
        for sample in family.samples
        if sample.name == "stabmon_internal_errors_total"
    }


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_run_dir_filling_up_mid_run_is_counted_logged_once_and_training_goes_on(
    attach: MonitorFactory, small_filesystem: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, run_dir=str(small_filesystem), sample_seconds=0.05)
    train_step(model, optimizer, monitor, nan_grad=True)
    assert _errors(monitor)["event_log"] == 0
    _fill(small_filesystem)
    for step in range(30):
        train_step(model, optimizer, monitor, nan_grad=step % 3 == 0)
        monitor.epoch_end()  # one epoch record per step: many writes into a full disk
    assert monitor.state_dict()["step"] == 31
    errors = _errors(monitor)
    assert errors["event_log"] >= 10  # every failed write counted
    lines = [line for line in _warnings(caplog) if "contained an error in event_log" in line]
    assert len(lines) == 1
    assert "No space left on device" in lines[0]


def test_run_dir_on_a_full_file_system_from_the_start_is_counted_and_training_goes_on(
    small_filesystem: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _fill(small_filesystem)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(small_filesystem),
        run_id="full", sample_seconds=0.05,
    )  # fmt: skip
    try:
        for _ in range(5):
            train_step(model, optimizer, monitor)
        assert monitor.metrics_url is not None  # the exporter needs no disk
        errors = _errors(monitor)
        assert errors["event_log"] + errors["rundir"] >= 1
        failures = [line for line in _warnings(caplog) if "No space left on device" in line]
        assert 1 <= len(failures) <= 2  # once per component: the event log, the run record
    finally:
        monitor.detach()


def test_run_dir_on_a_read_only_file_system_is_counted_logged_once_and_training_goes_on(
    small_filesystem: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Linux refuses a read-only remount while a file is open for writing, so it comes first.
    (small_filesystem / "ro").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_filesystem)], check=True, timeout=20)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(small_filesystem / "ro"),
        run_id="read-only", sample_seconds=0.05,
    )  # fmt: skip
    try:
        for step in range(10):
            train_step(model, optimizer, monitor, nan_grad=step == 5)
        assert monitor.state_dict()["step"] == 10
        assert monitor.metrics_url is not None
        errors = _errors(monitor)
        assert errors["event_log"] >= 1 and errors["rundir"] >= 1
        read_only = [line for line in _warnings(caplog) if "Read-only file system" in line]
        # Once each: the event log, the run record, and the skip file naming the batches of
        # step 5's NaN (by their content hashes: this loop passes no ids).
        assert len(read_only) == 3, read_only
        assert sum("skip_batches.json" in line for line in read_only) == 1
    finally:
        monitor.detach()
    assert not any(small_filesystem.joinpath("ro").iterdir())
