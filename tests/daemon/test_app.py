"""DaemonApp with a fake NVML and a real run directory, scraped over real HTTP."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from fake_nvml import FakeGpu, FakeNvml
from helpers import scrape

from stabmon import contract
from stabmon.config import load_config
from stabmon.daemon.app import DaemonApp
from stabmon.hardware.nvml import GpuProcess
from stabmon.shared.rundir import ProcessRecord, boot_id, write_atomic

UUIDS = ("GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000")


def _register_self(run_dir: Path, *, declared: tuple[str, ...]) -> None:
    """A record for this test process, as a training process would write it."""
    (run_dir / "job").mkdir(parents=True, exist_ok=True)
    record = ProcessRecord(
        pid=os.getpid(), create_time=psutil.Process().create_time(), run="job", rank=3,
        hostname=socket.gethostname(), boot_id=boot_id(), gpu_uuids=declared,
        attached_unix=time.time(), last_step_unix=time.time(), steps=5, updated_unix=time.time(),
    )  # fmt: skip
    write_atomic(run_dir / "job" / "rank-3.json", record.to_json())


@pytest.fixture
def app(tmp_path: Path) -> Iterator[DaemonApp]:
    gpus = [
        FakeGpu(uuid=UUIDS[0], utilization_percent=87, processes=[GpuProcess(os.getpid(), 2**30)]),
        FakeGpu(uuid=UUIDS[1], utilization_percent=3, processes=[GpuProcess(os.getpid(), 2**20)]),
    ]
    config = load_config(
        {"run_dir": str(tmp_path), "daemon": {"port": 0, "address": "127.0.0.1", "interval": 0.1}},
        env={},
    )
    _register_self(tmp_path, declared=(UUIDS[0],))  # declared GPU 0, but also holds memory on 1
    daemon = DaemonApp(config, reader=FakeNvml(gpus))
    assert daemon.start()
    yield daemon
    daemon.stop()


def test_daemon_serves_every_row_of_the_daemon_table(app: DaemonApp) -> None:
    time.sleep(0.3)
    samples = scrape(app.url)
    exported = {name.removesuffix("_total") for name, _ in samples}
    for metric in contract.DAEMON_METRICS:
        if metric is contract.GPU_XID_ERRORS:
            continue  # its children appear with the first XID of a kind
        assert metric.name.removesuffix("_total") in exported, metric.name
    gpu0 = {"gpu": "0", "uuid": UUIDS[0]}
    assert samples[("stabmon_gpu_utilization_ratio", frozenset(gpu0.items()))] == pytest.approx(
        0.87
    )
    process = {"rank": "3", "run": "job", "pid": str(os.getpid())}
    assert samples[("stabmon_process_up", frozenset(process.items()))] == 1


def test_daemon_counts_memory_on_an_undeclared_gpu_as_a_device_mismatch(app: DaemonApp) -> None:
    time.sleep(0.3)
    samples = scrape(app.url)
    assert samples[("stabmon_anomalies_total", frozenset({("kind", "device_mismatch")}))] == 1
    held = {dict(lbl)["gpu"]: v for (n, lbl), v in samples.items()
            if n == "stabmon_process_gpu_memory_bytes"}  # fmt: skip
    assert held == {"0": 2**30, "1": 2**20}


def test_daemon_exports_its_own_contained_errors_and_poll_health(app: DaemonApp) -> None:
    samples = scrape(app.url)
    assert samples[("stabmon_internal_errors_total", frozenset({("component", "nvml")}))] == 0
    for poller in ("nvml", "processes"):
        assert ("stabmon_daemon_last_poll_timestamp_seconds",
                frozenset({("poller", poller)})) in samples  # fmt: skip
        assert ("stabmon_daemon_poll_duration_seconds", frozenset({("poller", poller)})) in samples


def test_daemon_exposition_has_one_help_line_per_metric(app: DaemonApp) -> None:
    import urllib.request

    assert app.url is not None
    with urllib.request.urlopen(app.url, timeout=5) as response:
        text = response.read().decode()
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP")]
    assert len(helps) == len(set(helps))  # strict parsers reject a family declared twice


def test_daemon_stop_returns_without_waiting_out_the_poll_interval(tmp_path: Path) -> None:
    config = load_config(
        {"run_dir": str(tmp_path), "daemon": {"port": 0, "interval": 3600}}, env={}
    )
    daemon = DaemonApp(config, reader=FakeNvml([FakeGpu(uuid=UUIDS[0])]))
    assert daemon.start()
    started = time.monotonic()
    daemon.stop()
    # Not a timing window: a stop that waited for the next poll would take an hour.
    assert time.monotonic() - started < 600


def test_daemon_without_a_driver_serves_process_metrics(tmp_path: Path) -> None:
    _register_self(tmp_path, declared=())
    config = load_config({"run_dir": str(tmp_path), "daemon": {"port": 0}}, env={})
    daemon = DaemonApp(config, reader=FakeNvml(available=False))
    assert daemon.start()
    try:
        samples = scrape(daemon.url)
    finally:
        daemon.stop()
    assert samples[("stabmon_daemon_nvml_up", frozenset())] == 0
    assert any(name == "stabmon_process_up" for name, _ in samples)


def test_sighup_stops_the_daemon_cleanly_and_frees_its_port(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    code = "import sys; from stabmon.cli import main; sys.exit(main(sys.argv[1:]))"
    daemon = subprocess.Popen(
        [sys.executable, "-c", code, "daemon", "--port", "0", "--address", "127.0.0.1",
         "--run-dir", str(tmp_path), "--interval", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert daemon.stdout is not None
    assert daemon.stdout.readline().startswith("stabmon daemon: serving http://127.0.0.1:")
    daemon.send_signal(signal.SIGHUP)  # a closed terminal, or a supervisor's reload signal
    out, err = daemon.communicate(timeout=60)
    assert daemon.returncode == 0
    assert "SIGHUP, stopping" in err and "stopped in" in err
