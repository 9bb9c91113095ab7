"""The daemon's node view of a hang: real ranks' records, judged per run and user, scraped.

The ranks are real processes (``sleep``, standing in for stalled trainers), registered by
the real record writer (:class:`stabmon.shared.rundir.Registration`) with the hang evidence a
stalled rank writes; the daemon runs with a fake NVML (there is no GPU here) and is scraped
over real HTTP. The real torchrun case is in tests/integration/test_hang_triage.py.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from fake_nvml import FakeNvml
from helpers import scrape

from stabmon.config import load_config
from stabmon.daemon.app import DaemonApp
from stabmon.daemon.hang import NodeHangJudge
from stabmon.daemon.processes import ProcessSample
from stabmon.shared.log import LogLimiter
from stabmon.shared.own_record import Registration
from stabmon.shared.rundir import ProcessRecord, RunPaths, boot_id

WHERE = {"collective": "c10d_logger.py:81 in wrapper", "data_wait": "data.py:42 in __getitem__"}


@pytest.fixture
def ranks() -> Iterator[list[subprocess.Popen[bytes]]]:
    started = [subprocess.Popen(["sleep", "120"]) for _ in range(4)]
    try:
        yield started
    finally:
        for process in started:
            process.kill()
            process.wait()


def _register(root: Path, rank: int, pid: int, state: str | None, collectives: int = 40) -> Path:
    """What a rank writes: its record at attach, then its hang evidence once stalled."""
    record = ProcessRecord(
        pid=pid, create_time=psutil.Process(pid).create_time(), run="job", rank=rank,
        hostname=socket.gethostname(), boot_id=boot_id(), attached_unix=time.time(),
    )  # fmt: skip
    path = RunPaths(root, "job", rank).record
    registration = Registration(root, path, record)
    registration.write(last_step_unix=time.time() - 30, steps=5, now=time.time(),
                       phase="backward", stall_limit_seconds=3.0)  # fmt: skip
    if state is not None:
        registration.hang(state=state, where=WHERE.get(state), collectives=collectives,
                          now=time.time())  # fmt: skip
    return path


def _verdicts(app: DaemonApp) -> dict[tuple[str, str, str], float]:
    return {
        (labels["rank"], labels["run"], labels["reason"]): value
        for (name, frozen), value in scrape(app.url).items()
        if name == "stabmon_node_hang_verdict"
        for labels in [dict(frozen)]
    }


def _daemon(root: Path) -> DaemonApp:
    config = load_config(
        {
            "run_dir": str(root),
            "scrape_cache_seconds": 0,
            "daemon": {"port": 0, "address": "127.0.0.1", "interval": 30},
        },
        env={},
    )
    app = DaemonApp(config, reader=FakeNvml([]))
    assert app.start()  # polls once before serving
    return app


def test_daemon_names_the_rank_starved_of_data_among_the_ranks_of_its_node(
    tmp_path: Path, ranks: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    for rank, process in enumerate(ranks):
        _register(tmp_path, rank, process.pid, "data_wait" if rank == 2 else "collective")
    with caplog.at_level(logging.ERROR, logger="stabmon"):
        app = _daemon(tmp_path)
    try:
        assert _verdicts(app) == {("2", "job", "data_starvation"): 1.0}
        assert any("hang verdict for run job: rank 2 of 4 stuck in data_wait" in r.getMessage()
                   for r in caplog.records)  # fmt: skip
    finally:
        app.stop()


def test_daemon_gives_no_verdict_while_a_rank_of_the_run_is_not_stalled(
    tmp_path: Path, ranks: list[subprocess.Popen[bytes]]
) -> None:
    # Rank 0 saves a checkpoint (not stalled); the others wait for it in a barrier.
    for rank, process in enumerate(ranks):
        _register(tmp_path, rank, process.pid, None if rank == 0 else "collective")
    app = _daemon(tmp_path)
    try:
        assert _verdicts(app) == {}
    finally:
        app.stop()


def test_daemon_verdict_clears_once_the_run_recovers(
    tmp_path: Path, ranks: list[subprocess.Popen[bytes]]
) -> None:
    for rank, process in enumerate(ranks):
        _register(tmp_path, rank, process.pid, "data_wait" if rank == 2 else "collective")
    app = _daemon(tmp_path)
    try:
        assert _verdicts(app) != {}
        _register(tmp_path, 2, ranks[2].pid, None)  # its loader delivered: a step completed
        app.poll_processes()
        assert _verdicts(app) == {}
    finally:
        app.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="Requires: root, to run a rank as another uid")
def test_daemon_never_mixes_another_users_rank_into_a_runs_verdict(
    tmp_path: Path, ranks: list[subprocess.Popen[bytes]]
) -> None:
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    # Another local user runs a process of its own and registers it as rank 3 of "job" in
    # the data loader: believed as its own process, but not one of this user's ranks.
    intruder = subprocess.Popen(["sleep", "120"], user=nobody)
    try:
        for rank, process in enumerate(ranks[:3]):
            _register(tmp_path, rank, process.pid, "collective")
        path = _register(tmp_path, 3, intruder.pid, "data_wait")
        os.chown(path, nobody, -1)
        app = _daemon(tmp_path)
        try:
            assert _verdicts(app) == {}
        finally:
            app.stop()
    finally:
        intruder.kill()
        intruder.wait()


def _sample(rank: int, state: str, uid: int, *, alive: bool = True) -> ProcessSample:
    record = ProcessRecord(pid=100 + rank, create_time=0.0, run="job", rank=rank,
                           hang_state=state, collectives=40)  # fmt: skip
    return ProcessSample(record, alive, False, None, None, None, None, 30.0, uid=uid)


def test_node_hang_judge_judges_each_user_of_a_run_id_apart() -> None:
    judge = NodeHangJudge(limiter=LogLimiter())
    ours = [_sample(rank, "collective", 1000) for rank in range(3)]
    theirs = [_sample(1, "data_wait", 2000)]
    assert judge.update([*ours, *theirs]) == {}


def test_node_hang_judge_gives_no_verdict_with_a_dead_rank() -> None:
    judge = NodeHangJudge(limiter=LogLimiter())
    samples = [_sample(rank, "collective", 1000) for rank in range(3)]
    samples.append(_sample(3, "data_wait", 1000, alive=False))
    assert judge.update(samples) == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="Requires: root, to run ranks as another uid")
def test_daemon_gives_no_verdict_for_a_run_id_another_user_also_registers_ranks_under(
    tmp_path: Path, ranks: list[subprocess.Popen[bytes]]
) -> None:
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    # The victim's ranks 0-2 of "job" train; another local user runs two processes of
    # its own and registers them as stalled ranks 4 and 5 of "job", one in its loader.
    intruders = [subprocess.Popen(["sleep", "120"], user=nobody) for _ in range(2)]
    try:
        for rank, process in enumerate(ranks[:3]):
            _register(tmp_path, rank, process.pid, None)
        for rank, (process, state) in enumerate(
            zip(intruders, ("collective", "data_wait"), strict=True), 4
        ):
            os.chown(_register(tmp_path, rank, process.pid, state), nobody, -1)
        app = _daemon(tmp_path)
        try:
            assert _verdicts(app) == {}  # not "rank 5 of job starved of data"
        finally:
            app.stop()
    finally:
        for process in intruders:
            process.kill()
            process.wait()


def test_node_hang_judge_logs_once_that_a_run_id_of_two_users_gets_no_verdict(
    caplog: pytest.LogCaptureFixture,
) -> None:
    judge = NodeHangJudge(limiter=LogLimiter())
    ours = [_sample(0, "collective", 1000), _sample(1, "data_wait", 1000)]
    theirs = [_sample(0, "collective", 2000), _sample(1, "data_wait", 2000)]
    assert judge.update(ours) != {}  # one user alone: judged
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        assert judge.update([*ours, *theirs]) == {}
        assert judge.update([*ours, *theirs]) == {}
    (record,) = [r for r in caplog.records if "registered by 2 local users" in r.getMessage()]
    assert "no hang verdict" in record.getMessage()
