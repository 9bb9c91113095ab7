"""Which registered ranks ``stabmon status`` lists, and which may get the operator's credentials."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from stabmon.report.status_targets import RegisteredTarget, may_authenticate, registered


def _record(root: Path, run: str, pid: int, create_time: float, url: str, rank: int = 0) -> None:
    (root / run).mkdir(exist_ok=True)
    record = {"version": 1, "pid": pid, "create_time": create_time, "run": run, "rank": rank,
              "metrics_url": url}  # fmt: skip
    (root / run / f"rank-{rank}.json").write_text(json.dumps(record))


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield int(listener.getsockname()[1])


def _target(port: int, **fields: object) -> RegisteredTarget:
    created = psutil.Process().create_time()
    mine = {"url": f"http://127.0.0.1:{port}/metrics", "owner_uid": os.geteuid(), "run": "r",
            "rank": "0", "pid": os.getpid(), "create_time": created}  # fmt: skip
    return RegisteredTarget(**(mine | fields))  # type: ignore[arg-type]


def test_registered_lists_live_ranks_first_and_only_the_callers_unless_everyone(
    tmp_path: Path,
) -> None:
    created = psutil.Process().create_time()
    _record(tmp_path, "a-dead", 4194303, 1.0, "http://127.0.0.1:9/metrics")
    _record(tmp_path, "b-live", os.getpid(), created, "http://127.0.0.1:9/metrics")
    found = registered(tmp_path)
    assert [(t.run, t.alive) for t in found.targets] == [("b-live", True), ("a-dead", False)]
    assert found.others == 0
    other = registered(tmp_path, uid=os.geteuid() + 1)
    assert other.targets == [] and other.others == 2
    assert len(registered(tmp_path, uid=os.geteuid() + 1, everyone=True).targets) == 2


def test_a_pid_reused_by_another_program_is_not_alive(tmp_path: Path) -> None:
    _record(tmp_path, "r", os.getpid(), psutil.Process().create_time() - 100.0, "http://x:1/")
    (target,) = registered(tmp_path).targets
    assert not target.alive


def test_credentials_go_to_our_live_process_listening_on_the_urls_port(listening: int) -> None:
    assert may_authenticate(_target(listening))
    assert may_authenticate(_target(listening, url=f"http://localhost:{listening}/metrics"))


def test_credentials_never_go_where_the_process_does_not_listen_or_is_not_ours(
    listening: int,
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = int(probe.getsockname()[1])
    assert not may_authenticate(_target(free))  # a port our process does not hold
    assert not may_authenticate(_target(listening, owner_uid=os.geteuid() + 1))
    assert not may_authenticate(_target(listening, alive=False))
    assert not may_authenticate(_target(listening, create_time=1.0))  # the pid was reused
    assert not may_authenticate(_target(listening, url=f"http://node-a:{listening}/"))  # no DNS
    assert not may_authenticate(_target(listening, url="http://127.0.0.1:99999/"))


def test_credentials_never_go_to_a_dead_process(listening: int) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(child.pid).create_time()
    child.wait()
    assert not may_authenticate(_target(listening, pid=child.pid, create_time=created))
