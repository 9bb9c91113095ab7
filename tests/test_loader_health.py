"""Data loader health with real worker processes: a loader that can hang, a worker that dies."""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MonitorFactory
from helpers import tiny_model
from torch.utils.data import DataLoader, Dataset

import stabmon


class SlowSquares(Dataset[torch.Tensor]):
    def __init__(self, length: int = 64, delay: float = 0.05) -> None:
        self.length, self.delay = length, delay

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.full((4,), float(index))


def _attach(attach: MonitorFactory) -> stabmon.Monitor:
    model = tiny_model()
    return attach(model, torch.optim.SGD(model.parameters(), lr=0.1), sample_seconds=0.1)


def _events(monitor: stabmon.Monitor) -> list[dict[str, Any]]:
    assert monitor.event_log_path is not None
    return [json.loads(x) for x in Path(monitor.event_log_path).read_text().splitlines()]


def test_a_loader_with_workers_and_no_timeout_is_warned_about_once(
    attach: MonitorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    monitor = _attach(attach)
    caplog.set_level(logging.WARNING, logger="stabmon")
    for _ in range(2):
        for _ in monitor.track(DataLoader(SlowSquares(8, 0.0), batch_size=4, num_workers=1)):
            pass
    assert caplog.text.count("num_workers=1 and timeout=0") == 1
    caplog.clear()
    for _ in monitor.track(DataLoader(SlowSquares(8, 0.0), batch_size=4, num_workers=0)):
        pass
    for _ in monitor.track(
        DataLoader(SlowSquares(8, 0.0), batch_size=4, num_workers=1, timeout=60)
    ):
        pass
    assert "timeout=0" not in caplog.text


def test_a_killed_worker_is_named_in_the_event_log(attach: MonitorFactory) -> None:
    """The loader's workers are shut down before the test ends, whatever it asserts.

    PyTorch's SIGCHLD handler raises "DataLoader worker ... is killed" in the main thread
    whenever any child exits while the broken iterator still lists the dead worker. The
    iterator is kept alive by the caught exception's traceback (a reference cycle): left to
    a later garbage collection, the next child to exit in any later test raised that error
    at a random point, inside pytest itself (INTERNALERROR). Collecting it here shuts the
    workers down, which removes their pids from the handler's list first.
    """
    import psutil

    monitor = _attach(attach)
    before = {child.pid for child in psutil.Process().children()}
    loader = DataLoader(SlowSquares(), batch_size=4, num_workers=2, timeout=60)
    batches = monitor.track(loader)
    try:
        next(batches)  # the workers run
        workers = [c.pid for c in psutil.Process().children() if c.pid not in before]
        assert len(workers) == 2, workers
        victim = workers[0]
        with pytest.raises(RuntimeError, match="DataLoader worker"):  # PyTorch's own error
            os.kill(victim, signal.SIGKILL)
            for _ in batches:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            died = [e for e in _events(monitor) if e["event"] == "loader_worker_died"]
            if died:
                break
            time.sleep(0.1)
        (event,) = died
        assert (event["pid"], event["signal"], event["exitcode"]) == (victim, "SIGKILL", -9)
    finally:
        batches.close()
        del batches, loader
        gc.collect()  # the iterator, held by the caught exception's traceback, shuts down
