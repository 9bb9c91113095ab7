"""The daemon when NVML breaks mid-run: it keeps serving everything else (real HTTP scrapes)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import psutil
from fake_nvml import FakeGpu, FakeNvml
from helpers import scrape, value

from stabmon.config import load_config
from stabmon.daemon.app import DaemonApp
from stabmon.shared.rundir import ProcessRecord, boot_id, write_atomic


def _register_self(run_dir: Path) -> None:
    (run_dir / "job").mkdir(parents=True, exist_ok=True)
    now = time.time()
    record = ProcessRecord(
        pid=os.getpid(), create_time=psutil.Process().create_time(), run="job", rank=0,
        hostname=socket.gethostname(), boot_id=boot_id(), gpu_uuids=(),
        attached_unix=now, last_step_unix=now, steps=1, updated_unix=now,
    )  # fmt: skip
    write_atomic(run_dir / "job" / "rank-0.json", record.to_json())


def test_daemon_keeps_serving_process_metrics_when_nvml_starts_failing_mid_run(
    tmp_path: Path,
) -> None:
    _register_self(tmp_path)
    fake = FakeNvml([FakeGpu(uuid="GPU-11111111-2222-3333-4444-555555555555")])
    config = load_config(
        {"run_dir": str(tmp_path), "daemon": {"port": 0, "address": "127.0.0.1", "interval": 0.1}},
        env={},
    )
    daemon = DaemonApp(config, reader=fake)
    assert daemon.start()
    try:
        samples = scrape(daemon.url)
        assert value(samples, "stabmon_daemon_nvml_up") == 1
        assert value(samples, "stabmon_gpu_utilization_ratio") is not None
        fake.failing = True  # every NVML call raises from now on
        deadline = time.monotonic() + 10
        while value(samples := scrape(daemon.url), "stabmon_daemon_nvml_up") != 0:
            assert time.monotonic() < deadline, "NVML never reported down"
            time.sleep(0.1)
        assert value(samples, "stabmon_gpu_utilization_ratio") is None  # no stale GPU values
        assert value(samples, "stabmon_process_up", rank="0", run="job") == 1
        for _ in range(5):  # and it goes on answering
            assert value(scrape(daemon.url), "stabmon_process_up", rank="0") == 1
            time.sleep(0.15)
    finally:
        daemon.stop()
