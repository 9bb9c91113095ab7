"""Issue 21, item 7: an exporter that anyone can reach cannot be used to slow training."""

from __future__ import annotations

import select
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from stabmon.export.exporter import Exporter
from stabmon.shared.log import LogLimiter
from tests.security.conftest import Hostile


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


def test_idle_connections_hold_no_serving_slot_and_are_closed_after_the_request_line_time(
    started: list[Exporter],
) -> None:
    port = _start(started, CollectorRegistry(), max_connections=2, min_request_seconds=0.0)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
    try:
        assert _get(port).startswith(b"HTTP/1.0 200")  # served while both idle ones are open
        for connection in idle:  # never sent a request line: closed by the server
            assert connection.recv(1) == b""
    finally:
        for connection in idle:
            connection.close()


def test_the_listen_backlog_is_small_as_the_server_refuses_rather_than_queues(
    started: list[Exporter],
) -> None:
    if shutil.which("ss") is None:
        pytest.skip("Requires: ss (iproute2), to read a listening socket's backlog")
    from stabmon.export.exporter import BACKLOG

    port = _start(started, CollectorRegistry())
    lines = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                           check=True).stdout.split("\n")  # fmt: skip
    backlog = int(lines[0].split()[2])  # Send-Q of a listening socket: its backlog
    assert backlog == BACKLOG <= 64


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


# Issue 40: another user's idle connections and floods, against the rank's exporter and the
# daemon's (one server class serves both).

_IDLE = (
    "import socket, sys, time\n"
    "held = []\n"
    "for _ in range(int(sys.argv[2])):\n"
    "    try:\n"
    "        held.append(socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5))\n"
    "    except OSError:\n"
    "        pass\n"
    "print(len(held), flush=True)\n"
    "time.sleep(60)\n"
)


def _scrape_ok(port: int, timeout: float = 10.0) -> bool:
    import urllib.request

    try:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _exporter_port(started: list[Exporter]) -> int:
    return _start(started, CollectorRegistry())


def _daemon_port(tmp_path: Path) -> tuple[int, object]:
    from stabmon.config import load_config
    from stabmon.daemon.app import DaemonApp
    from tests.daemon.fake_nvml import FakeNvml

    config = load_config(
        {"run_dir": str(tmp_path), "daemon": {"port": 0, "address": "127.0.0.1", "interval": 60}},
        env={},
    )
    app = DaemonApp(config, reader=FakeNvml([]))
    assert app.start() and app.url is not None
    return int(app.url.rsplit(":", 1)[1].split("/")[0]), app


@pytest.mark.parametrize("server", ["rank", "daemon"])
def test_132_idle_connections_of_another_user_keep_no_server_unreachable(
    hostile: Hostile, started: list[Exporter], tmp_path: Path, server: str
) -> None:
    app = None
    if server == "rank":
        port = _exporter_port(started)
    else:
        port, app = _daemon_port(tmp_path)
    holder = hostile.start(_IDLE, str(port), "132")
    try:
        assert holder.stdout is not None and int(holder.stdout.readline()) > 0
        # The subprocess-free scrape's timeout is a hang guard: today it never comes back
        # within it (132 connections waited in turn for minutes).
        assert _scrape_ok(port, timeout=10.0)
    finally:
        holder.kill()
        holder.communicate(timeout=30)
        if app is not None:
            app.stop()  # type: ignore[attr-defined]


def test_a_request_that_finds_no_place_within_a_second_is_refused_not_queued(
    started: list[Exporter],
) -> None:
    from stabmon.export.limits import PENDING

    # Two slots, each held 5 s once taken. The first request is served (its place is free
    # again once answered), the next 1 + PENDING wait in their places for a slot; the last
    # place is kept for a known scraper.
    port = _start(started, CollectorRegistry(), max_connections=2, min_request_seconds=5.0)
    request = b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n"
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2 + PENDING)]
    try:
        for connection in held:
            connection.sendall(request)
        time.sleep(0.3)  # the server gives each a place
        with socket.create_connection(("127.0.0.1", port), timeout=30) as extra:
            extra.sendall(request)
            assert extra.recv(100).startswith(b"HTTP/1.0 503")  # refused, then closed
    finally:
        for connection in held:
            connection.close()


_FLOOD = (
    "import socket, sys, threading, time\n"
    "port, seconds = int(sys.argv[1]), float(sys.argv[2])\n"
    "request = b'GET /metrics HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n'\n"
    "end = time.monotonic() + seconds\n"
    "def flood():\n"
    "    while time.monotonic() < end:\n"
    "        try:\n"
    "            s = socket.socket(); s.settimeout(5); s.bind(('127.0.0.2', 0))\n"
    "            s.connect(('127.0.0.1', port)); s.sendall(request)\n"
    "            while s.recv(65536):\n"
    "                pass\n"
    "            s.close()\n"
    "        except OSError:\n"
    "            pass\n"
    "threads = [threading.Thread(target=flood) for _ in range(int(sys.argv[3]))]\n"
    "[t.start() for t in threads]\n"
    "print('flooding', flush=True)\n"
    "[t.join() for t in threads]\n"
)


@pytest.mark.slow
def test_a_scraper_that_has_been_answered_is_served_through_another_users_flood(
    hostile: Hostile, started: list[Exporter]
) -> None:
    port = _start(started, CollectorRegistry())
    assert _scrape_ok(port)  # Prometheus, answered before the flood: a known scraper
    flood = hostile.start(_FLOOD, str(port), "12", "50")  # from another address (127.0.0.2)
    try:
        assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
        served = 0
        for _ in range(5):
            time.sleep(1.0)  # a scrape interval, as short as Prometheus allows in practice
            served += _scrape_ok(port, timeout=2.0)  # a short scrape timeout
    finally:
        flood.kill()
        flood.communicate(timeout=30)
    assert served == 5
