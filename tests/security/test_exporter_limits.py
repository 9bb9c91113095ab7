"""Issue 21, item 7: an exporter that anyone can reach cannot be used to slow training."""

from __future__ import annotations

import select
import shutil
import socket
import subprocess
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge

from stabmon.export.exporter import Exporter
from stabmon.shared.log import LogLimiter


@pytest.fixture
def started() -> Iterator[list[Exporter]]:
    exporters: list[Exporter] = []
    yield exporters
    for exporter in exporters:
        exporter.stop()


def _start(exporters: list[Exporter], registry: CollectorRegistry, **limits: object) -> int:
    exporter = Exporter(registry, address="127.0.0.1", ports=[0], limiter=LogLimiter(), **limits)  # type: ignore[arg-type]
    assert exporter.start()
    exporters.append(exporter)
    assert exporter.port is not None
    return exporter.port


def _get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_trickling_client_is_cut_off_at_the_whole_request_deadline(
    started: list[Exporter],
) -> None:
    port = _start(started, CollectorRegistry(), request_seconds=0.5)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        sent = 0
        closed = False
        # A request line sent one byte every 0.1 s would take 20 s; each byte comes well
        # within any per-read timeout. The server must close the connection on its own.
        for byte in b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"a" * 170:
            try:
                connection.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            sent += 1
            readable, _, _ = select.select([connection], [], [], 0.1)
            if readable and not connection.recv(1024):
                closed = True
                break
        assert closed, "the exporter kept a trickling client for the whole request"
        assert sent < 190


def test_at_most_max_connections_are_served_at_once_and_the_rest_wait(
    started: list[Exporter],
) -> None:
    port = _start(started, CollectorRegistry(), max_connections=2, min_request_seconds=0.0)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
    try:
        waiting = socket.create_connection(("127.0.0.1", port), timeout=30)
        waiting.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        readable, _, _ = select.select([waiting], [], [], 1.0)
        assert not readable  # both slots are held by the idle clients: not accepted yet
        idle[0].close()  # a slot frees: the waiting request is served
        response = b""
        while chunk := waiting.recv(65536):
            response += chunk
        assert response.startswith(b"HTTP/1.0 200")
        waiting.close()
    finally:
        for connection in idle:
            connection.close()


def test_the_listen_backlog_holds_a_flood_of_connections(started: list[Exporter]) -> None:
    if shutil.which("ss") is None:
        pytest.skip("Requires: ss (iproute2), to read a listening socket's backlog")
    from stabmon.export.exporter import BACKLOG

    port = _start(started, CollectorRegistry())
    lines = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                           check=True).stdout.split("\n")  # fmt: skip
    backlog = int(lines[0].split()[2])  # Send-Q of a listening socket: its backlog
    assert backlog >= BACKLOG >= 128


def test_the_scrape_body_is_reused_for_cache_seconds_on_the_injected_clock(
    started: list[Exporter],
) -> None:
    registry = CollectorRegistry()
    gauge = Gauge("flood_value", "a value that changes", registry=registry)
    now = [100.0]
    port = _start(started, registry, cache_seconds=1.0, clock=lambda: now[0])
    gauge.set(1)
    assert b"flood_value 1.0" in _get(port)
    gauge.set(2)
    assert b"flood_value 1.0" in _get(port)  # cached
    now[0] += 1.0
    assert b"flood_value 2.0" in _get(port)
