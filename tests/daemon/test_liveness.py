"""What the daemon tells beyond up/down, scraped over real HTTP: each rank's own stall limit,
how a process ended, XID counts that survive a restart, and a health check that needs no
credentials and says nothing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from fake_nvml import FakeGpu, FakeNvml
from helpers import scrape

from stabmon.config import load_config
from stabmon.daemon.app import DaemonApp
from stabmon.daemon.xid_state import XidState, state_path
from stabmon.shared.log import LogLimiter
from stabmon.shared.rundir import ProcessRecord, boot_id, read_records, write_atomic

UUID = "GPU-11111111-2222-3333-4444-555555555555"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
AppFactory = Callable[..., DaemonApp]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[AppFactory]:
    """``daemon(reader, **config)``: a started DaemonApp on ``tmp_path``; stopped after."""
    started: list[DaemonApp] = []

    def factory(reader: FakeNvml | None = None, **settings: object) -> DaemonApp:
        config = load_config(
            {"run_dir": str(tmp_path), "daemon": {"port": 0, "address": "127.0.0.1",
                                                  "interval": 0.1}, **settings},
            env={},
        )  # fmt: skip
        app = DaemonApp(config, reader=reader if reader is not None else FakeNvml([FakeGpu(UUID)]))
        assert app.start()
        started.append(app)
        return app

    yield factory
    for app in started:
        app.stop()


def _register(run_dir: Path, rank: int, pid: int, create_time: float, **fields: object) -> None:
    record = ProcessRecord(
        pid=pid, create_time=create_time, run="job", rank=rank, boot_id=boot_id(),
        attached_unix=time.time(), last_step_unix=time.time(), updated_unix=time.time(),
        **fields,  # type: ignore[arg-type]  # test records set the optional fields by name
    )  # fmt: skip
    (run_dir / "job").mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "job" / f"rank-{rank}.json", record.to_json())


def _ended_process() -> tuple[int, float]:
    """The pid and create time of a process that has already exited."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    create_time = psutil.Process(child.pid).create_time()
    child.wait(10)
    return child.pid, create_time


def _find(samples: Samples, name: str, **labels: str) -> float | None:
    for (metric, found), sample in samples.items():
        if metric == name and set(labels.items()) <= found:
            return sample
    return None


def test_daemon_exports_each_ranks_stall_limit_from_its_record(
    daemon: AppFactory, tmp_path: Path
) -> None:
    me = psutil.Process()
    _register(tmp_path, 0, os.getpid(), me.create_time(), phase="eval", stall_limit_seconds=3600.0)
    app = daemon()
    samples = scrape(app.url)
    assert _find(samples, "stabmon_process_stall_limit_seconds", rank="0", run="job") == 3600.0
    assert _find(samples, "stabmon_process_exit_reason", rank="0") is None  # alive


def test_daemon_labels_a_down_process_with_how_it_ended(daemon: AppFactory, tmp_path: Path) -> None:
    for rank, status in enumerate(("exception", "signal", None)):
        pid, create_time = _ended_process()
        exited = time.time() if status else None
        _register(tmp_path, rank, pid, create_time, exit_status=status, exited_unix=exited)
    samples = scrape(daemon().url)
    assert _find(samples, "stabmon_process_exit_reason", rank="0", reason="exception") == 1
    assert _find(samples, "stabmon_process_exit_reason", rank="1", reason="signal") == 1
    assert _find(samples, "stabmon_process_exit_reason", rank="2", reason="vanished") == 1
    for rank in "012":
        assert _find(samples, "stabmon_process_up", rank=rank) == 0


def _until_sample(app: DaemonApp, name: str, expected: float, **labels: str) -> Samples:
    deadline = time.monotonic() + 5.0
    while True:
        samples = scrape(app.url)
        if _find(samples, name, **labels) == expected:
            return samples
        assert time.monotonic() < deadline, f"{name}{labels} never reached {expected}"
        time.sleep(0.05)


def test_xid_counts_and_last_event_time_survive_a_daemon_restart(daemon: AppFactory) -> None:
    first = FakeNvml([FakeGpu(UUID)])
    app = daemon(first)
    first.push_xid(0, 79)
    samples = _until_sample(app, "stabmon_gpu_xid_errors_total", 1.0, uuid=UUID, xid="79")
    when = _find(samples, "stabmon_gpu_xid_last_event_timestamp_seconds", uuid=UUID, xid="79")
    assert when is not None and abs(when - time.time()) < 60
    app.stop()

    second = FakeNvml([FakeGpu(UUID)])
    restarted = daemon(second)
    samples = scrape(restarted.url)  # before any new event: the saved count, not a reset
    assert _find(samples, "stabmon_gpu_xid_errors_total", uuid=UUID, xid="79") == 1
    last_event = "stabmon_gpu_xid_last_event_timestamp_seconds"
    assert _find(samples, last_event, uuid=UUID, xid="79") == when
    second.push_xid(0, 79)
    _until_sample(restarted, "stabmon_gpu_xid_errors_total", 2.0, uuid=UUID, xid="79")


def test_xid_state_refuses_a_directory_that_is_not_the_daemons_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = state_path(tmp_path)
    path.parent.mkdir(parents=True)
    someone_else = os.geteuid() + 1
    state = XidState(path, limiter=LogLimiter(), uid=lambda: someone_else)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        state.record(0, UUID, 79, now=1000.0)
    assert not path.exists()
    assert state.counts() == {(0, UUID, 79): 1}  # still counted, in memory
    assert "not keeping XID state" in caplog.text and "belongs to uid" in caplog.text


def test_xid_state_ignores_a_symlinked_or_corrupt_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = state_path(tmp_path)
    path.parent.mkdir(parents=True, mode=0o700)
    target = tmp_path / "elsewhere.json"
    target.write_text('{"version": 1, "xids": [{"uuid": "x", "xid": 79, "index": 0, '
                      '"count": 9, "last_unix": 1.0}]}')  # fmt: skip
    path.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        assert XidState(path, limiter=LogLimiter()).counts() == {}
        path.unlink()
        path.write_text('{"version": 1, "xids": [{"uuid": "x", "xid": -1}]}')
        assert XidState(path, limiter=LogLimiter()).counts() == {}
    assert caplog.text.count("ignoring the XID state") == 2


def test_daemon_health_check_answers_without_credentials_and_reveals_nothing(
    daemon: AppFactory, tmp_path: Path
) -> None:
    credentials = tmp_path / "credentials"
    credentials.write_text("prometheus:s3cret\n")
    app = daemon(basic_auth_file=str(credentials))
    assert app.url is not None
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(app.url, timeout=5)
    health = app.url.replace("/metrics", "/healthz")
    with urllib.request.urlopen(health, timeout=5) as response:
        assert response.status == 200
        assert response.read() == b"ok\n"
    with pytest.raises(urllib.error.HTTPError, match="401"):  # the other routes still ask
        urllib.request.urlopen(app.url.replace("/metrics", "/targets"), timeout=5)


_INTERRUPTED = """
import sys, time
from pathlib import Path
from stabmon.shared.rundir import ProcessRecord
from stabmon.shared.own_record import ExitWatch, Registration
import psutil, os
root = Path(sys.argv[1])
record = ProcessRecord(pid=os.getpid(), create_time=psutil.Process().create_time(), run="job",
                       rank=0)
registration = Registration(root, root / "job" / "rank-0.json", record)
registration.write(last_step_unix=None, steps=0, now=time.time(), phase="forward",
                   stall_limit_seconds=60.0)
ExitWatch.install()
import atexit
atexit.register(lambda: registration.exited(ExitWatch.status(), time.time(),
                                            signal_name=ExitWatch.signal_name()))
raise KeyboardInterrupt
"""


def test_a_process_ended_by_ctrl_c_records_a_signal_not_a_crash(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", _INTERRUPTED, str(tmp_path)], env=env,
                   capture_output=True, check=False, timeout=60)  # fmt: skip
    records, problems = read_records(tmp_path)
    assert problems == []
    (record,) = records
    assert (record.exit_status, record.exit_signal) == ("signal", "SIGINT")
    assert (record.phase, record.stall_limit_seconds) == ("forward", 60.0)
