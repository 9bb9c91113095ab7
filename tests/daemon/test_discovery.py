"""The daemon's /targets: Prometheus HTTP service discovery of the node's training ranks."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MonitorFactory
from fake_nvml import FakeNvml
from helpers import tiny_model

from stabmon.config import load_config
from stabmon.daemon.app import DaemonApp
from stabmon.daemon.discovery import target_groups
from stabmon.daemon.processes import ProcessSample
from stabmon.shared.rundir import ProcessRecord


def _sample(rank: int, url: str | None, *, alive: bool = True) -> ProcessSample:
    """A sample whose URL's port the poll verified as listening (see tests/security)."""
    record = ProcessRecord(pid=100 + rank, create_time=1.0, run="job", rank=rank,
                           local_rank=rank, metrics_url=url)  # fmt: skip
    port = urllib.parse.urlsplit(url).port if url else None
    return ProcessSample(record, alive, False, None, None, None, None, None, target_port=port)


def test_targets_list_live_ranks_with_their_real_port_on_the_requested_host() -> None:
    samples = [
        _sample(1, "http://127.0.0.1:9405/metrics"),  # fell back from 9401
        _sample(0, "http://127.0.0.1:9400/metrics"),
        _sample(2, "http://127.0.0.1:9402/metrics", alive=False),  # crashed: not a target
        _sample(3, None),  # serve_metrics: false
    ]
    groups = target_groups(samples, "node7")
    assert [g["targets"] for g in groups] == [["node7:9400"], ["node7:9405"]]
    assert groups[1]["labels"] == {
        "__meta_stabmon_run": "job",
        "__meta_stabmon_rank": "1",
        "__meta_stabmon_local_rank": "1",
        "__meta_stabmon_pid": "101",
    }


def test_targets_use_the_node_host_name_never_the_records_without_a_host_header() -> None:
    import socket

    node = socket.gethostname().lower()
    assert target_groups([_sample(0, "http://10.0.0.5:9400/metrics")], None)[0]["targets"] == [
        f"{node}:9400"
    ]
    assert target_groups([_sample(0, "http://x:9400/metrics")], "::1")[0]["targets"] == [
        "[::1]:9400"
    ]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonApp]:
    config = load_config(
        {"run_dir": str(tmp_path), "daemon": {"port": 0, "address": "127.0.0.1", "interval": 0.1}},
        env={},
    )
    app = DaemonApp(config, reader=FakeNvml([]))
    assert app.start()
    yield app
    app.stop()


def _get(url: str, path: str, host: str | None = None, method: str = "GET") -> tuple[int, bytes]:
    netloc = urllib.parse.urlsplit(url).netloc
    connection = http.client.HTTPConnection(netloc, timeout=5)
    headers = {"Host": host} if host else {}
    connection.request(method, path, headers=headers)
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response.status, body


def _targets(daemon: DaemonApp, host: str) -> list[dict[str, Any]]:
    assert daemon.url is not None
    status, body = _get(daemon.url, "/targets", host)
    assert status == 200
    groups: list[dict[str, Any]] = json.loads(body)
    return groups


def test_daemon_serves_a_real_monitor_as_a_target_and_drops_it_after_detach(
    daemon: DaemonApp, attach: MonitorFactory, tmp_path: Path
) -> None:
    model = tiny_model()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=str(tmp_path),
                     run_id="sd", address="127.0.0.1", port=0)  # fmt: skip
    assert monitor.metrics_url is not None
    port = urllib.parse.urlsplit(monitor.metrics_url).port
    deadline = time.monotonic() + 5
    while not (groups := _targets(daemon, "gpu-node-3:9399")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [g["targets"] for g in groups] == [[f"gpu-node-3:{port}"]]
    assert groups[0]["labels"]["__meta_stabmon_run"] == "sd"

    monitor.detach()
    deadline = time.monotonic() + 5
    while _targets(daemon, "gpu-node-3") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _targets(daemon, "gpu-node-3") == []


def test_exporter_answers_only_its_paths_and_methods(daemon: DaemonApp) -> None:
    assert daemon.url is not None
    assert _get(daemon.url, "/metrics")[0] == 200
    assert _get(daemon.url, "/")[0] == 404
    assert _get(daemon.url, "/secret/../metrics")[0] == 404
    assert _get(daemon.url, "/metrics", method="POST")[0] == 405
    status, body = _get(daemon.url, "/targets", method="HEAD")
    assert (status, body) == (200, b"")


@pytest.mark.parametrize(
    ("header", "host"),
    [
        ("node7:9399", "node7"),
        ("GPU-Node-3.example.org", "gpu-node-3.example.org"),
        ("[::1]:9399", "::1"),
        ("10.1.2.3:80", "10.1.2.3"),
        ("[::1", None),  # broken brackets: no 500, no traceback in the log
        ("node 1", None),
        ('evil"host', None),
        ("a" * 60_000, None),
        ("", None),
    ],
)
def test_only_a_host_name_or_address_from_the_host_header_is_used(
    header: str, host: str | None
) -> None:
    from stabmon.daemon.discovery import _request_host

    assert _request_host({"HTTP_HOST": header}) == host


def test_a_malformed_host_header_falls_back_to_the_bound_address(daemon: DaemonApp) -> None:
    assert daemon.url is not None
    status, body = _get(daemon.url, "/targets", "[::1")
    assert status == 200 and json.loads(body) == []
