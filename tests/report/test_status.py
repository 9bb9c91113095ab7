"""`stabmon status` against real exporters over HTTP: the table, and its exit code."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch
from helpers import LoopClock, tiny_model, train_step
from report_helpers import stabmon_cli

import stabmon


def _rows(stdout: str) -> list[str]:
    return stdout.splitlines()[1:]


def test_status_of_a_healthy_run_prints_its_rank_and_exits_0(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(tmp_path), run_id="healthy"
    ) as monitor:
        for _ in range(25):
            train_step(model, optimizer, monitor)

        result = stabmon_cli("status", "--run-dir", str(tmp_path))

    assert result.returncode == 0, result.stdout + result.stderr
    header, *rows = result.stdout.splitlines()
    for column in ("run", "rank", "steps", "steps/s", "step age", "grad norm", "nonfinite",
                   "memory", "drift", "stalled", "leak", "anomalies", "health"):  # fmt: skip
        assert column in header
    assert len(rows) == 1
    cells = rows[0].split()
    assert cells[:3] == ["healthy", "0", "25"]
    assert re.fullmatch(r"\d+\.\ds", cells[4])  # seconds since the last step
    assert "MiB host" in rows[0] and rows[0].rstrip().endswith("ok")


def test_status_exits_1_when_a_rank_saw_a_non_finite_gradient(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(tmp_path), run_id="nan",
        judge_seconds=0,  # status scrapes mid-run
    ) as monitor:  # fmt: skip
        for step in range(10):
            train_step(model, optimizer, monitor, nan_grad=step == 4)
        url = monitor.metrics_url
        assert url is not None

        result = stabmon_cli("status", url)

    assert result.returncode == 1, result.stdout + result.stderr
    (row,) = _rows(result.stdout)
    assert "UNHEALTHY: non-finite" in row
    assert row.split()[6] == "1"  # the nonfinite column


def test_status_exits_1_when_a_rank_is_stalled(tmp_path: Path) -> None:
    clock = LoopClock()
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(tmp_path), run_id="hung",
        stall_seconds=0.3, clock=clock,
    ) as monitor:  # fmt: skip
        for _ in range(5):
            train_step(model, optimizer, monitor)
        clock.advance(1.0)  # the loop hangs past its limit
        deadline = time.monotonic() + 30
        result = stabmon_cli("status", "--run-dir", str(tmp_path), "--run", "hung")
        while "stalled" not in result.stdout.splitlines()[-1] and time.monotonic() < deadline:
            time.sleep(0.2)  # the watchdog looks four times a second
            result = stabmon_cli("status", "--run-dir", str(tmp_path), "--run", "hung")

    assert result.returncode == 1, result.stdout + result.stderr
    (row,) = _rows(result.stdout)
    assert "UNHEALTHY: stalled" in row
    assert row.split()[:3] == ["hung", "0", "5"]


def test_status_of_an_exporter_that_does_not_answer_exits_1(tmp_path: Path) -> None:
    import socket

    with socket.socket() as listener:  # a port nobody serves once closed
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]

    result = stabmon_cli("status", f"http://127.0.0.1:{port}/metrics", "--timeout", "2")

    assert result.returncode == 1
    assert "UNREACHABLE" in result.stdout


def test_status_with_nothing_registered_exits_2_with_one_line(tmp_path: Path) -> None:
    result = stabmon_cli("status", "--run-dir", str(tmp_path))

    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "no running stabmon process is registered" in result.stderr


def test_status_reaches_an_exporter_behind_tls_and_basic_auth_with_its_files(
    tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    credentials = tmp_path / "scrape-auth"
    credentials.write_text("scraper:s3cret\n")
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(tmp_path / "runs"),
        run_id="secure", tls_certfile=str(cert), tls_keyfile=str(key),
        basic_auth_file=str(credentials),
    ) as monitor:  # fmt: skip
        for _ in range(5):
            train_step(model, optimizer, monitor)
        url = monitor.metrics_url
        assert url is not None and url.startswith("https://127.0.0.1:")

        plain = stabmon_cli("status", url)
        secure = stabmon_cli("status", url, "--cafile", str(cert),
                             "--basic-auth-file", str(credentials))  # fmt: skip
        wrong = tmp_path / "wrong-auth"
        wrong.write_text("scraper:guess\n")
        refused = stabmon_cli("status", url, "--cafile", str(cert),
                              "--basic-auth-file", str(wrong))  # fmt: skip

    assert secure.returncode == 0, secure.stdout + secure.stderr
    assert _rows(secure.stdout)[0].split()[:3] == ["secure", "0", "5"]
    assert plain.returncode == 1 and "UNREACHABLE" in plain.stdout  # the certificate is not trusted
    assert refused.returncode == 1
    assert "HTTP 401 Unauthorized (see --basic-auth-file)" in refused.stdout


def test_status_with_an_unreadable_cafile_exits_2_with_one_line(tmp_path: Path) -> None:
    result = stabmon_cli("status", "https://127.0.0.1:1/metrics",
                         "--cafile", str(tmp_path / "absent.pem"))  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"stabmon: error: --cafile {tmp_path / 'absent.pem'}: ")


def test_status_names_the_run_and_rank_of_a_registered_rank_that_does_not_answer(
    tmp_path: Path,
) -> None:
    import json
    import os
    import socket

    with socket.socket() as listener:  # a port nobody serves once closed
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
    record = {"pid": os.getpid(), "create_time": 1.0, "run": "job", "rank": 3, "local_rank": 3,
              "hostname": "h", "gpu_uuids": [], "cuda_visible_devices": None,
              "metrics_url": f"http://127.0.0.1:{port}/metrics", "attached_unix": 1.0,
              "last_step_unix": None, "steps": 0, "updated_unix": 1.0, "stall_seconds": None,
              "boot_id": "", "pid_namespace": "", "exited_unix": None, "exit_status": None,
              "version": 1}  # fmt: skip
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "rank-3.json").write_text(json.dumps(record))

    result = stabmon_cli("status", "--run-dir", str(tmp_path), "--timeout", "2")

    assert result.returncode == 1, result.stderr
    (row,) = [line for line in result.stdout.splitlines() if "UNREACHABLE" in line]
    assert row.split()[:2] == ["job", "3"]


def test_a_rank_whose_replicas_differ_is_unhealthy_and_says_why() -> None:
    from stabmon.report.status import _statuses

    labels = {"run": "sdc", "rank": "2"}
    samples = [
        ("stabmon_steps_total", labels, 300.0),
        ("stabmon_replica_checks_total", labels, 3.0),
        ("stabmon_replica_mismatches_total", labels, 1.0),
    ]
    (status,) = _statuses("http://127.0.0.1:1/metrics", samples, now=0.0)

    assert not status.healthy
    assert status.problems == ["replicas differ (silent data corruption)"]
