"""Issue 21, item 1: ``stabmon status`` and URLs another user wrote into the run directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stabmon import contract
from stabmon.cli import main
from tests.security.conftest import Hostile

_BODY = (
    f'# TYPE {contract.STEPS.name} counter\n{contract.STEPS.name}_total{{run="r",rank="0"}} 5.0\n'
).encode()


class _Capture(BaseHTTPRequestHandler):
    seen: list[str | None]

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.seen.append(self.headers.get("Authorization"))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(_BODY)))
        self.end_headers()
        self.wfile.write(_BODY)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def capture() -> Iterator[tuple[str, list[str | None]]]:
    """A loopback server that records the Authorization header of every request."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics", server.seen  # type: ignore[attr-defined]
    server.shutdown()
    server.server_close()
    thread.join()


_WRITE_RECORD = (
    "import json, os, sys; d = os.path.join(sys.argv[1], 'theirs'); os.mkdir(d);"
    "open(os.path.join(d, 'rank-0.json'), 'w').write(json.dumps({'version': 1, 'pid': os.getpid(),"
    "'create_time': 1.0, 'run': 'theirs', 'rank': 0, 'metrics_url': sys.argv[2]}))"
)


@pytest.fixture
def credentials(tmp_path: Path) -> Path:
    path = tmp_path / "auth"
    path.write_text("operator:s3cret\n")
    return path


def test_status_never_sends_credentials_to_a_url_another_user_registered(
    hostile: Hostile, shared: Path, credentials: Path, capture: tuple[str, list[str | None]]
) -> None:
    url, seen = capture
    hostile.run(_WRITE_RECORD, str(shared), url)
    main(["status", "--run-dir", str(shared), "--basic-auth-file", str(credentials)])
    assert seen == [None]  # scraped, but without the operator's credentials


def test_status_sends_credentials_to_a_url_given_on_the_command_line(
    credentials: Path, capture: tuple[str, list[str | None]]
) -> None:
    url, seen = capture
    main(["status", url, "--basic-auth-file", str(credentials)])
    assert len(seen) == 1 and seen[0] is not None and seen[0].startswith("Basic ")


def test_status_refuses_a_file_url_another_user_registered(
    hostile: Hostile, shared: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = Path("/etc/shadow") if Path("/etc/shadow").exists() else Path("/etc/passwd")
    hostile.run(_WRITE_RECORD, str(shared), f"file://{secret}")
    assert main(["status", "--run-dir", str(shared)]) == 1
    out = capsys.readouterr().out
    first_line = secret.read_text().splitlines()[0]
    assert first_line[:10] not in out
    assert "reads only http(s)" in out


_STATUS = "import sys; from stabmon.cli import main; sys.exit(main(sys.argv[1:]))"


def test_status_on_a_fifo_url_ends_within_its_timeout(hostile: Hostile, shared: Path) -> None:
    fifo = shared / "fifo"
    os.mkfifo(fifo, 0o666)
    hostile.run(_WRITE_RECORD, str(shared), f"file://{fifo}")
    # The subprocess timeout is a hang guard (today it never returns), not a timing assertion.
    result = subprocess.run(
        [sys.executable, "-c", _STATUS, "status", "--run-dir", str(shared), "--timeout", "0.5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "UNREACHABLE" in result.stdout


def _trickle(listener: socket.socket, stop: threading.Event) -> None:
    connection, _ = listener.accept()
    with connection:
        for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"#" * 100000:
            if stop.is_set():
                return
            try:
                connection.sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(0.05)


def test_status_gives_up_on_a_server_that_trickles_after_its_timeout() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()
    thread = threading.Thread(target=_trickle, args=(listener, stop), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
    try:
        result = subprocess.run(
            [sys.executable, "-c", _STATUS, "status", url, "--timeout", "0.5"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        stop.set()
        listener.close()
    assert result.returncode == 1
    assert "within 0.5 s" in result.stdout


def test_status_refuses_a_fifo_as_its_ca_file_with_one_line(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "ca.pem")
    result = subprocess.run(
        [sys.executable, "-c", _STATUS, "status", "http://127.0.0.1:1/metrics",
         "--cafile", str(tmp_path / "ca.pem")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--cafile" in result.stderr
