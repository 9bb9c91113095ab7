"""Issue 21, items 3 to 5: the node daemon and records, bytes and processes it cannot trust."""

from __future__ import annotations

import http.client
import json
import logging
import os
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stabmon import contract
from stabmon.config import load_config
from stabmon.daemon.app import DaemonApp
from stabmon.daemon.processes import ProcessTable
from stabmon.export.exporter import Exporter
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter
from stabmon.shared.rundir import ProcessRecord, boot_id, run_directory_name, write_atomic
from tests.daemon.fake_nvml import FakeNvml
from tests.helpers import scrape, value
from tests.security.conftest import NOBODY, Hostile


@pytest.fixture
def daemon_for(tmp_path: Path) -> Iterator[object]:
    started: list[DaemonApp] = []

    def start(run_dir: Path) -> DaemonApp:
        config = load_config(
            {"run_dir": str(run_dir), "scrape_cache_seconds": 0,
             "daemon": {"port": 0, "address": "127.0.0.1", "interval": 60}},
            env={},
        )  # fmt: skip
        app = DaemonApp(config, reader=FakeNvml([]))
        assert app.start()
        started.append(app)
        return app

    yield start
    for app in started:
        app.stop()


def _get(url: str | None, path: str, host: str = "gpu-node-3:9399") -> tuple[int, bytes]:
    assert url is not None
    connection = http.client.HTTPConnection(url.split("/")[2], timeout=10)
    connection.request("GET", path, headers={"Host": host})
    response = connection.getresponse()
    return response.status, response.read()


_CLAIM = (
    "import json, os, sys; d = os.path.join(sys.argv[1], sys.argv[2]);"
    "os.makedirs(d, exist_ok=True);"
    "open(os.path.join(d, 'rank-0.json'), 'w').write(json.dumps({'version': 1,"
    "'pid': int(sys.argv[3]), 'create_time': float(sys.argv[4]), 'run': sys.argv[2], 'rank': 0,"
    "'boot_id': sys.argv[5], 'metrics_url': 'http://169.254.169.254:80/latest/meta-data',"
    "'updated_unix': 1.0}))"
)


def test_daemon_ignores_records_another_user_wrote_for_pid_1_and_for_the_daemon_itself(
    hostile: Hostile, shared: Path, daemon_for
) -> None:
    for run, pid in (("claims-init", 1), ("claims-daemon", os.getpid())):
        created = str(psutil.Process(pid).create_time())
        hostile.run(_CLAIM, str(shared), run, str(pid), created, boot_id())
    app = daemon_for(shared)
    app.poll_processes()
    samples = scrape(app.url)
    assert value(samples, contract.PROCESS_UP.name, run="claims-init") is None
    assert value(samples, contract.PROCESS_UP.name, run="claims-daemon") is None
    status, body = _get(app.url, "/targets")
    assert status == 200 and json.loads(body) == []


_LISTENER = textwrap.dedent(
    """
    import json, os, socket, sys, time
    import psutil
    root, run, claimed_port = sys.argv[1], sys.argv[2], sys.argv[3]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1] if claimed_port == "own" else int(claimed_port)
    os.makedirs(os.path.join(root, run), exist_ok=True)
    record = {"version": 1, "pid": os.getpid(), "create_time": psutil.Process().create_time(),
              "run": run, "rank": 0, "boot_id": sys.argv[4],
              "metrics_url": f"http://10.9.9.9:{port}/elsewhere", "updated_unix": time.time()}
    open(os.path.join(root, run, "rank-0.json"), "w").write(json.dumps(record))
    print(port, flush=True)
    time.sleep(60)
    """
)


def test_targets_name_only_ports_the_process_user_really_listens_on_at_this_node(
    hostile: Hostile, shared: Path, daemon_for
) -> None:
    app = daemon_for(shared)
    daemon_port = app.url.rsplit(":", 1)[1].split("/")[0]  # type: ignore[union-attr]
    honest = hostile.start(_LISTENER, str(shared), "honest", "own", boot_id())
    liar = hostile.start(_LISTENER, str(shared), "liar", daemon_port, boot_id())
    try:
        assert honest.stdout is not None and liar.stdout is not None
        port = int(honest.stdout.readline())
        liar.stdout.readline()
        app.poll_processes()
        status, body = _get(app.url, "/targets", host="gpu-node-3:9399")
    finally:
        for process in (honest, liar):
            process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()
    assert status == 200
    groups = json.loads(body)
    # The liar claims the daemon's port (root's socket, not nobody's): not advertised.
    assert [group["targets"] for group in groups] == [[f"gpu-node-3:{port}"]]
    assert "__metrics_path__" not in groups[0]["labels"]


def _own_record(run_dir: Path, run: str, **fields: object) -> None:
    record = ProcessRecord(
        pid=os.getpid(), create_time=psutil.Process().create_time(), run="placeholder", rank=0,
        boot_id=boot_id(), updated_unix=time.time(),
    )  # fmt: skip
    data = json.loads(record.to_json()) | {"run": run} | fields
    directory = run_dir / run_directory_name(run)  # a run's records live in its directory
    directory.mkdir()
    (directory / "rank-0.json").write_text(json.dumps(data))


def test_a_lone_surrogate_run_id_or_a_bad_port_in_one_record_takes_no_endpoint_down(
    tmp_path: Path, daemon_for
) -> None:
    _own_record(tmp_path, "good")
    _own_record(tmp_path, "\ud800")
    _own_record(tmp_path, "bad-port", metrics_url="http://127.0.0.1:99999/metrics")
    app = daemon_for(tmp_path)
    app.poll_processes()
    status, body = _get(app.url, "/metrics")
    assert status == 200 and b'run="good"' in body
    status, body = _get(app.url, "/targets")
    assert status == 200


class _Failing(Collector):
    def collect(self) -> Iterator[Metric]:
        raise RuntimeError("a collector that fails on every scrape")


class _Good(Collector):
    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("good_value", "still served", value=1.0)


class _Unencodable(Collector):
    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("bad_label", "a label no exposition can encode", labels=["run"])
        family.add_metric(["\udcff"], 1.0)
        yield family


def test_a_failing_collector_is_left_out_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    registry.register(_Unencodable())
    registry.register(_Good())
    registry.register(_Failing())
    guard = Guard(LogLimiter(), ["exporter"])
    exporter = Exporter(registry, address="127.0.0.1", ports=[0], limiter=LogLimiter(), guard=guard)
    assert exporter.start()
    try:
        with caplog.at_level(logging.WARNING, logger="stabmon"):
            for _ in range(3):
                status, body = _get(exporter.url, "/metrics")
                assert status == 200 and b"good_value 1.0" in body
    finally:
        exporter.stop()
    assert guard.counts["exporter"] == 6  # two failures a scrape, three scrapes
    assert caplog.text.count("RuntimeError") == 1 and "Traceback" not in caplog.text


def test_records_claiming_pid_1_with_every_process_as_a_child_sample_a_bounded_few(
    tmp_path: Path,
) -> None:
    from stabmon.daemon.processes import MAX_CHILDREN

    # As root, pid 1 is this user's: believed; its descendants are every process on the node.
    (tmp_path / "init").mkdir()
    record = ProcessRecord(pid=1, create_time=psutil.Process(1).create_time(), run="init", rank=0,
                           updated_unix=time.time())  # fmt: skip
    write_atomic(tmp_path / "init" / "rank-0.json", record.to_json())
    ticks = iter(range(10**6))
    table = ProcessTable(tmp_path, limiter=LogLimiter(), budget_clock=lambda: next(ticks) * 0.1)
    (sample,) = table.poll()
    if psutil.Process(1).uids().real != os.geteuid():
        assert not sample.alive  # not root: another user's pid 1 is not believed
        return
    assert len(sample.worker_pids) <= min(3, MAX_CHILDREN)


def test_records_beyond_the_cap_are_not_read(tmp_path: Path) -> None:
    from stabmon.shared.rundir import MAX_RECORDS

    dead = ProcessRecord(pid=2**22 - 1, create_time=1.0, run="x", rank=0, updated_unix=time.time())
    for index in range(MAX_RECORDS + 40):
        directory = tmp_path / f"run-{index:05d}"
        directory.mkdir()
        data = json.loads(dead.to_json()) | {"run": f"run-{index:05d}"}
        (directory / "rank-0.json").write_text(json.dumps(data))
    samples = ProcessTable(tmp_path, limiter=LogLimiter()).poll()
    assert len(samples) <= MAX_RECORDS


def test_a_record_dated_in_the_future_is_forgotten_by_the_daemons_own_clock(
    tmp_path: Path,
) -> None:
    now = [1_000_000.0]
    (tmp_path / "future").mkdir()
    record = ProcessRecord(pid=2**22 - 1, create_time=1.0, run="future", rank=0,
                           updated_unix=now[0] + 10 * 365 * 86400.0)  # fmt: skip
    write_atomic(tmp_path / "future" / "rank-0.json", record.to_json())
    table = ProcessTable(tmp_path, limiter=LogLimiter(), clock=lambda: now[0],
                         forget_after_seconds=3600.0, boot_id=lambda: "")  # fmt: skip
    assert [s.record.run for s in table.poll()] == ["future"]
    now[0] += 3601.0
    assert table.poll() == []


def test_the_log_limiter_remembers_a_bounded_number_of_keys_and_bounds_each_value(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from stabmon.shared.log import MAX_ARG_CHARS, MAX_KEYS

    limiter = LogLimiter()
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        assert limiter.once("key-0", logging.WARNING, "first %s", "x")
        for index in range(1, MAX_KEYS + 1):
            limiter.once(f"key-{index}", logging.WARNING, "n")
        assert limiter.once("key-0", logging.WARNING, "again")  # forgotten: bounded memory
        caplog.clear()
        limiter.once("huge", logging.WARNING, "value %s", "v" * 60_000)
    assert len(caplog.records[0].getMessage()) < MAX_ARG_CHARS + 100


# Issue 40: trust by owner. A run's name belongs to the uid owning its directory.

_DEAD_RECORDS = (
    "import json, os, sys\n"
    "for index in range(int(sys.argv[2])):\n"
    "    run = f'{index:04d}'\n"  # digits: sort before any letter
    "    os.mkdir(os.path.join(sys.argv[1], run))\n"
    "    open(os.path.join(sys.argv[1], run, 'rank-0.json'), 'w').write(json.dumps({'version': 1,"
    "'pid': 4194303, 'create_time': 1.0, 'run': run, 'rank': 0, 'updated_unix': 4e9}))\n"
)


@pytest.fixture
def listening() -> Iterator[int]:
    """A port this (the victim's) process listens on, as its exporter would."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield int(listener.getsockname()[1])


def _victim(root: Path, port: int, run: str = "victim") -> None:
    record = ProcessRecord(
        pid=os.getpid(), create_time=psutil.Process().create_time(), run=run, rank=0,
        boot_id=boot_id(), updated_unix=time.time(), metrics_url=f"http://127.0.0.1:{port}/metrics",
    )  # fmt: skip
    (root / run).mkdir()
    write_atomic(root / run / "rank-0.json", record.to_json())


def test_600_dead_records_of_another_user_sorted_first_do_not_hide_a_live_rank(
    hostile: Hostile, shared: Path, daemon_for, listening: int
) -> None:
    hostile.run(_DEAD_RECORDS, str(shared), "600")
    _victim(shared, listening)
    app = daemon_for(shared)
    app.poll_processes()
    samples = scrape(app.url)
    assert value(samples, contract.PROCESS_UP.name, run="victim") == 1.0
    status, body = _get(app.url, "/targets")
    assert [group["targets"] for group in json.loads(body)] == [[f"gpu-node-3:{listening}"]]


_IMPOSTER = textwrap.dedent(
    """
    import json, os, socket, sys, time
    import psutil
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    directory = os.path.join(sys.argv[1], sys.argv[2])
    os.makedirs(directory, exist_ok=True)
    record = {"version": 1, "pid": os.getpid(), "create_time": psutil.Process().create_time(),
              "run": "victim", "rank": 0, "boot_id": sys.argv[3],
              "metrics_url": f"http://127.0.0.1:{port}/metrics"}
    print(port, flush=True)
    while True:  # rewritten often, always the freshest record of rank 0 of "victim"
        record["updated_unix"] = time.time() + 3600
        open(os.path.join(directory, "rank-0.json"), "w").write(json.dumps(record))
        time.sleep(0.05)
    """
)


def test_another_users_record_naming_the_victims_run_is_ignored_and_counted(
    hostile: Hostile, shared: Path, daemon_for, listening: int
) -> None:
    _victim(shared, listening)
    imposter = hostile.start(_IMPOSTER, str(shared), "victim-2", boot_id())
    try:
        assert imposter.stdout is not None
        theirs = int(imposter.stdout.readline())
        app = daemon_for(shared)
        for _ in range(5):
            app.poll_processes()
            status, body = _get(app.url, "/targets")
            assert [group["targets"] for group in json.loads(body)] == [[f"gpu-node-3:{listening}"]]
        samples = scrape(app.url)
    finally:
        imposter.kill()
        imposter.wait()
        if imposter.stdout is not None:
            imposter.stdout.close()
    assert theirs != listening
    assert value(samples, contract.PROCESS_UP.name, run="victim", pid=str(os.getpid())) == 1.0
    assert value(samples, contract.PROCESS_UP.name, run="victim", pid=str(imposter.pid)) is None
    assert (value(samples, contract.INTERNAL_ERRORS.name, component="rundir") or 0) >= 1


_JUNK = (
    "import os, sys\n"
    "d = os.path.join(sys.argv[1], 'aaa'); os.mkdir(d)\n"
    "for index in range(int(sys.argv[2])):\n"
    "    open(os.path.join(d, f'rank-{index}.json'), 'w').write('{not json')\n"
)


def test_thousands_of_junk_records_of_one_user_cost_a_bounded_poll_and_log(
    hostile: Hostile, shared: Path, listening: int, caplog: pytest.LogCaptureFixture
) -> None:
    from stabmon.daemon.processes import LOGGED_PROBLEMS_PER_OWNER
    from stabmon.shared.rundir import MAX_FILES_PER_OWNER

    hostile.run(_JUNK, str(shared), "3000")
    _victim(shared, listening)
    table = ProcessTable(shared, limiter=LogLimiter())
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        for _ in range(3):
            (sample,) = table.poll()
            assert sample.alive and sample.record.run == "victim"
    per_file = [r for r in caplog.records if "not a usable registration record" in r.getMessage()]
    assert len(per_file) <= 3 * LOGGED_PROBLEMS_PER_OWNER  # not one line per file
    summaries = [r.getMessage() for r in caplog.records if "more unusable" in r.getMessage()]
    assert summaries and f"{NOBODY}: " in summaries[0]
    from stabmon.shared.rundir import read_owned_records

    _, problems = read_owned_records(shared)
    assert len(problems) <= MAX_FILES_PER_OWNER + 1  # the rest: one summary, not read
