"""Issue 21, item 1: ``stabmon status`` and URLs another user wrote into the run directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from stabmon import contract
from stabmon.cli import main
from tests.security.conftest import Hostile

_STEPS_FAMILY = contract.STEPS.name.removesuffix("_total")
_BODY = (
    f'# TYPE {_STEPS_FAMILY} counter\n{contract.STEPS.name}{{run="r",rank="0"}} 5.0\n'
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
    main(["status", "--run-dir", str(shared), "--basic-auth-file", str(credentials), "--all"])
    assert all(header is None for header in seen)  # never the operator's credentials


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
    assert main(["status", "--run-dir", str(shared), "--all"]) == 1
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
        [sys.executable, "-c", _STATUS, "status", "--run-dir", str(shared), "--timeout", "0.5",
         "--all"],
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


# Issue 40: a record outlives its process; the port it names may be anyone's next.

_STEAL = textwrap.dedent(
    """
    import socket, sys
    listener = socket.socket()
    listener.bind(("127.0.0.1", int(sys.argv[1])))
    listener.listen()
    print("ready", flush=True)
    listener.settimeout(20)
    try:
        connection, _ = listener.accept()
    except OSError:
        sys.exit(0)
    connection.settimeout(5)
    request = b""
    while b"\\r\\n\\r\\n" not in request:
        chunk = connection.recv(4096)
        if not chunk:
            break
        request += chunk
    lines = request.decode().split("\\r\\n")
    stolen = [line for line in lines if line.lower().startswith("authorization")]
    print("STOLEN " + (stolen[0] if stolen else "nothing"), flush=True)
    connection.sendall(b"HTTP/1.0 404 Not Found\\r\\nContent-Length: 0\\r\\n\\r\\n")
    connection.close()
    """
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _operator_record(root: Path, run: str, pid: int, create_time: float, url: str) -> None:
    import json

    (root / run).mkdir()
    record = {"version": 1, "pid": pid, "create_time": create_time, "run": run, "rank": 0,
              "metrics_url": url, "updated_unix": time.time()}  # fmt: skip
    (root / run / "rank-0.json").write_text(json.dumps(record))


def _steal(hostile: Hostile, port: int) -> subprocess.Popen[str]:
    thief = hostile.start(_STEAL, str(port))
    assert thief.stdout is not None and thief.stdout.readline().strip() == "ready"
    return thief


def _stolen(thief: subprocess.Popen[str]) -> str:
    thief.kill()  # it answers one connection at most; one that never came leaves it waiting
    out, _ = thief.communicate(timeout=30)
    return out


def test_status_never_sends_credentials_to_the_freed_port_of_a_killed_rank(
    hostile: Hostile, shared: Path, credentials: Path
) -> None:
    # The operator's rank was killed (SIGKILL, the OOM killer): its record stays behind.
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    created = psutil.Process(rank.pid).create_time()
    port = _free_port()
    _operator_record(shared, "victim", rank.pid, created, f"http://127.0.0.1:{port}/metrics")
    rank.kill()
    rank.wait()
    thief = _steal(hostile, port)  # another user binds the freed port
    try:
        code = main(["status", "--run-dir", str(shared), "--basic-auth-file", str(credentials),
                     "--timeout", "2"])  # fmt: skip
    finally:
        out = _stolen(thief)
    assert "s3cret" not in out and "Basic" not in out
    assert code == 1  # reported down, not scraped


def test_status_never_sends_credentials_to_a_port_its_live_rank_does_not_hold(
    hostile: Hostile, shared: Path, credentials: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # This process is the operator's live rank, but the port its record names is another
    # user's socket (the rank moved to another port, or never bound that one).
    port = _free_port()
    created = psutil.Process().create_time()
    _operator_record(shared, "victim", os.getpid(), created, f"http://127.0.0.1:{port}/metrics")
    thief = _steal(hostile, port)
    try:
        main(["status", "--run-dir", str(shared), "--basic-auth-file", str(credentials),
              "--timeout", "2"])  # fmt: skip
    finally:
        out = _stolen(thief)
    assert "STOLEN nothing" in out  # scraped, without the operator's credentials


def test_status_sends_credentials_to_its_own_live_rank_that_listens_there(
    shared: Path, credentials: Path, capture: tuple[str, list[str | None]]
) -> None:
    url, seen = capture  # served by this very process, the record's pid
    _operator_record(shared, "r", os.getpid(), psutil.Process().create_time(), url)
    assert main(["status", "--run-dir", str(shared), "--basic-auth-file", str(credentials)]) == 0
    assert len(seen) == 1 and seen[0] is not None and seen[0].startswith("Basic ")


_DEAD_RECORDS = (
    "import json, os, sys\n"
    "for index in range(int(sys.argv[2])):\n"
    "    run = f'{index:04d}'\n"  # digits: sort before any letter
    "    os.mkdir(os.path.join(sys.argv[1], run))\n"
    "    open(os.path.join(sys.argv[1], run, 'rank-0.json'), 'w').write(json.dumps({'version': 1,"
    "'pid': 4194303, 'create_time': 1.0, 'run': run, 'rank': 0, 'updated_unix': 4e9,"
    "'metrics_url': 'http://127.0.0.1:9/metrics'}))\n"
)


def test_status_finds_a_live_rank_behind_600_dead_records_another_user_sorted_first(
    hostile: Hostile, shared: Path, capture: tuple[str, list[str | None]],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url, _ = capture
    hostile.run(_DEAD_RECORDS, str(shared), "600")
    _operator_record(shared, "r", os.getpid(), psutil.Process().create_time(), url)
    assert main(["status", "--run-dir", str(shared)]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:2] for row in rows] == [["r", "0"]]  # only ours, by default


# Another user's live process, with records of its own: argv = root, then "run:rank:url"...
_LIVE_RECORDS = textwrap.dedent(
    """
    import json, os, socket, sys, time
    import psutil
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)  # never accepts: a connection waits for ever
    port = listener.getsockname()[1]
    created = psutil.Process().create_time()
    for claim in sys.argv[2:]:
        run, rank, url = claim.split(":", 2)
        os.makedirs(os.path.join(sys.argv[1], run), exist_ok=True)
        record = {"version": 1, "pid": os.getpid(), "create_time": created, "run": run,
                  "rank": int(rank), "updated_unix": time.time(),
                  "metrics_url": url.replace("PORT", str(port))}
        open(os.path.join(sys.argv[1], run, f"rank-{rank}.json"), "w").write(json.dumps(record))
    print(port, flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def neighbour(hostile: Hostile) -> Iterator[object]:
    started: list[subprocess.Popen[str]] = []

    def start(root: Path, *claims: str) -> int:
        process = hostile.start(_LIVE_RECORDS, str(root), *claims)
        started.append(process)
        assert process.stdout is not None
        return int(process.stdout.readline())

    yield start
    for process in started:
        process.kill()
        process.communicate(timeout=30)


def test_a_record_copying_the_victims_url_neither_strips_its_credentials_nor_renames_its_row(
    neighbour, shared: Path, credentials: Path, capture: tuple[str, list[str | None]],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url, seen = capture
    _operator_record(shared, "r", os.getpid(), psutil.Process().create_time(), url)
    neighbour(shared, f"zz:7:{url}")
    main(["status", "--run-dir", str(shared), "--basic-auth-file", str(credentials), "--all"])
    rows = capsys.readouterr().out.splitlines()[1:]
    assert sorted(header is not None for header in seen) == [False, True]  # ours only to ours
    mine = [row for row in rows if row.split()[:2] == ["r", "0"]]
    assert len(mine) == 1 and mine[0].rstrip().endswith("ok")
    (theirs,) = [row for row in rows if row.split()[:2] == ["zz", "7"]]
    assert "does not serve rank 7 of run zz" in theirs


_FAKE_STALL = (
    f'# TYPE {_STEPS_FAMILY} counter\n{contract.STEPS.name}{{run="r",rank="0"}} 5.0\n'
    f'# TYPE {contract.STALLED.name} gauge\n{contract.STALLED.name}{{run="r",rank="0"}} 1.0\n'
)
_FAKE_EXPORTER = textwrap.dedent(
    """
    import json, os, sys, time, psutil
    from http.server import BaseHTTPRequestHandler, HTTPServer
    body = sys.argv[2].encode()
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    server = HTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    os.makedirs(os.path.join(sys.argv[1], "theirs"))
    record = {"version": 1, "pid": os.getpid(), "create_time": psutil.Process().create_time(),
              "run": "theirs", "rank": 0, "updated_unix": time.time(),
              "metrics_url": f"http://127.0.0.1:{port}/metrics"}
    open(os.path.join(sys.argv[1], "theirs", "rank-0.json"), "w").write(json.dumps(record))
    print(port, flush=True)
    server.serve_forever()
    """
)


def test_a_fake_exporter_of_another_user_cannot_report_the_victims_rank_stalled(
    hostile: Hostile, shared: Path, capture: tuple[str, list[str | None]],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url, _ = capture
    _operator_record(shared, "r", os.getpid(), psutil.Process().create_time(), url)
    fake = hostile.start(_FAKE_EXPORTER, str(shared), _FAKE_STALL)
    try:
        assert fake.stdout is not None and fake.stdout.readline()
        assert main(["status", "--run-dir", str(shared)]) == 0  # a probe sees only our runs
        main(["status", "--run-dir", str(shared), "--all"])
    finally:
        fake.kill()
        fake.communicate(timeout=30)
    rows = [row for row in capsys.readouterr().out.splitlines() if not row.startswith("run ")]
    assert not any("stalled" in row for row in rows)
    assert any("does not serve rank 0 of run theirs" in row for row in rows)


def test_status_scrapes_20_records_at_a_socket_that_never_answers_within_one_timeout(
    neighbour, shared: Path
) -> None:
    neighbour(shared, *(f"slow{index:02d}:0:http://127.0.0.1:PORT/metrics" for index in range(20)))
    # One deadline for all: 2 s, where one after another took 20 x 2 s. The subprocess
    # timeout is a hang guard with a wide margin, not a timing assertion.
    result = subprocess.run(
        [sys.executable, "-c", _STATUS, "status", "--run-dir", str(shared), "--all",
         "--timeout", "2"],
        capture_output=True, text=True, timeout=25,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stdout.count("no whole answer within 2 s") == 20


def test_status_refuses_a_run_directory_root_another_user_owns_with_one_line(
    hostile: Hostile, shared: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = shared / "their-root"
    hostile.run("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o1777)", str(root))
    assert main(["status", "--run-dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "owned by uid 65534" in err
