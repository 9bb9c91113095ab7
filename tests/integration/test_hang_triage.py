"""A hung 4-rank torchrun job (gloo on CPU) names its culprit rank and why, and never a
false one: through the event log, ``stabmon status``, ``stabmon report``, the node daemon and
the shipped alert in a real Prometheus; with ``stall_action: exit``, the job ends.

Short stall limits (3 s) keep each job within a minute; waits are bounded, never timed. A
job of 4 ranks is most of a test's cost (five processes importing torch), so each job is
read every way it can be, rather than started once per way of reading it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import scrape
from realstack import (
    Processes,
    announced,
    free_port,
    host_port,
    require,
    start_prometheus,
    until,
)

from stabmon.report.events import read_run
from stabmon.report.verdict import judge as judge_run

pytestmark = pytest.mark.slow

TRAINEE = Path(__file__).parent / "hang_trainee.py"
WORLD = 4
#: Bounded waits: generous for a busy 2-core machine; never asserted as durations.
VERDICT_TIMEOUT = 120.0


@pytest.fixture
def processes() -> Iterator[Processes]:
    started = Processes()
    try:
        yield started
    finally:
        started.close()


def _torchrun(
    processes: Processes, run_dir: Path, *args: str, world: int = WORLD
) -> subprocess.Popen[str]:
    env = {**os.environ, "STABMON_DIR": str(run_dir), "STABMON_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    env.pop("STABMON_RUN_ID", None)
    return processes.start(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={world}", str(TRAINEE), *args],
        env=env,
    )  # fmt: skip


def _events(run_dir: Path, event: str) -> list[dict[str, Any]]:
    found = []
    for path in sorted(run_dir.glob("*/rank-*.events.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if record.get("event") == event:
                found.append(record)
    return found


def _status(run_dir: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "stabmon", "status", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return result.stdout


def _loader_worker_frame() -> str:
    """Where the culprit's DataLoader worker blocks, as its stack dump names it."""
    lines = TRAINEE.read_text().splitlines()
    line = next(n for n, text in enumerate(lines, 1) if "a stuck input pipeline" in text)
    return f"hang_trainee.py:{line} in __getitem__"


@pytest.mark.parametrize(
    ("mode", "workers", "culprit", "reason", "state", "verdict"),
    [
        # The culprit's dataset blocks inside its DataLoader worker process, as a real input
        # pipeline does; the main thread only waits on a queue. (A main thread blocked in its
        # own get_batch is the two-rank job's case below.)
        ("data", 1, 2, "data_starvation", "data_wait",
         "Verdict: rank 2 is stuck in data_wait (phase data_wait: data starvation)"),
        ("sleep", 0, 1, "collective_not_entered", "compute",
         "Verdict: rank 1 is stuck in compute (phase backward: collective not entered)"),
        ("deadlock", 0, 3, "deadlock", "lock_wait",
         "Verdict: rank 3 is stuck in lock_wait (phase backward: deadlock)"),
    ],
)  # fmt: skip
def test_a_hung_job_names_the_culprit_in_the_event_log_status_the_daemon_and_a_real_prometheus(
    tmp_path: Path,
    processes: Processes,
    mode: str,
    workers: int,
    culprit: int,
    reason: str,
    state: str,
    verdict: str,
) -> None:
    # One hung job per kind of hang, read every way a person reads it: the event log,
    # `stabmon status`, `stabmon report`, the node daemon and the shipped alert in a real
    # Prometheus (a job of 4 ranks is most of this test's cost, so it is started once).
    run_dir = tmp_path / "runs"
    daemon = processes.start([sys.executable, "-m", "stabmon", "daemon", "--port", "0",
                              "--address", "127.0.0.1", "--run-dir", str(run_dir),
                              "--interval", "0.5"])  # fmt: skip
    daemon_url = announced(daemon)
    _torchrun(processes, run_dir, "--mode", mode, "--culprit", str(culprit),
              "--workers", str(workers))  # fmt: skip
    prometheus = None
    if shutil.which("prometheus") is not None:
        prometheus = start_prometheus(processes, tmp_path, host_port(daemon_url))

    def named() -> bool:
        verdicts = _events(run_dir, "hang_verdict")
        return any(v["culprits"] == [culprit] and v["reason"] == reason for v in verdicts)

    until(f"a {reason} verdict naming rank {culprit}", named, VERDICT_TIMEOUT)
    verdicts = _events(run_dir, "hang_verdict")
    assert {(tuple(v["culprits"]), v["reason"]) for v in verdicts} == {((culprit,), reason)}
    assert verdicts[0]["detail"].startswith(f"rank {culprit} of {WORLD} stuck in {state}")
    # Every rank recorded its own evidence; the culprit's differs.
    evidence = {e["rank"]: e for e in _events(run_dir, "hang_evidence")}
    assert evidence[culprit]["state"] == state
    others = [e for rank, e in evidence.items() if rank != culprit]
    assert others and all(e["state"] == "collective" for e in others)
    assert all(e["collective"] == "all_reduce" for e in others)
    # torch's flight recorder (gloo too, in torch 2.13) counts what each rank enqueued.
    if mode == "sleep":  # the others enqueued the all_reduce the culprit never reached
        assert all(e["flight"][0] == evidence[culprit]["flight"][0] + 1 for e in others)
    if workers:  # the worker's own stack dump (faulthandler) says where it is stuck
        frame = _loader_worker_frame()
        assert verdicts[0]["detail"].startswith(
            f"rank {culprit} of {WORLD} stuck in data_wait at {frame} (loader worker 0)"
        )
        (worker,) = evidence[culprit]["worker_stacks"]
        assert worker["where"] == frame and worker["worker"] == 0
        assert "(most recent call first)" in worker["stack"]
        assert all(e["worker_stacks"] == [] for e in others)  # in all_reduce

    lines: list[str] = []

    def status_names_it() -> bool:
        lines[:] = [line for line in _status(run_dir).splitlines() if "HANG" in line]
        return any(f"HANG rank {culprit} of {WORLD} stuck in {state}" in line for line in lines)

    until("stabmon status naming the culprit", status_names_it, VERDICT_TIMEOUT)
    assert f"({reason})" in lines[0]
    # stabmon report's verdict carries it too.
    (directory,) = [path for path in run_dir.iterdir() if path.is_dir()]
    findings = judge_run(read_run(directory)).findings
    assert any("hang verdict" in line and f"rank {culprit} of {WORLD}" in line
               for line in findings), findings  # fmt: skip

    # The node daemon judged the same ranks from their records, and exports its verdict.
    def daemon_names_it() -> bool:
        verdicts = {dict(labels)["rank"] for (name, labels), value in scrape(daemon_url).items()
                    if name == "stabmon_node_hang_verdict" and value == 1}  # fmt: skip
        return verdicts == {str(culprit)}

    until(f"the daemon's verdict naming rank {culprit}", daemon_names_it, VERDICT_TIMEOUT, 0.5)

    if prometheus is None:
        require("prometheus")  # skips here on a developer's machine without it (fails in CI)

    def described() -> bool:
        assert prometheus is not None
        try:
            alerts = [a for a in prometheus.alerts() if a["labels"]["alertname"] ==
                      "StabmonTrainingStalled"]  # fmt: skip
        except OSError:
            return False  # Prometheus still starting
        ranks = {a["labels"]["rank"] for a in alerts if verdict in a["annotations"]["description"]}
        return ranks == {"0", "1", "2", "3"}

    # Pending alerts carry their annotations too: the rule's for: 1m is not waited for.
    until(f"every rank's stall alert naming rank {culprit}", described, VERDICT_TIMEOUT, 1.0)


def test_a_hung_two_rank_job_names_the_rank_not_in_the_collective(
    tmp_path: Path, processes: Processes
) -> None:
    # No strict majority of two: the rank waiting in all_reduce waits on the other.
    run_dir = tmp_path / "runs"
    _torchrun(processes, run_dir, "--mode", "data", "--culprit", "1", world=2)

    def named() -> bool:
        return any(v["culprits"] == [1] for v in _events(run_dir, "hang_verdict"))

    until("a verdict naming rank 1 of 2", named, VERDICT_TIMEOUT)
    verdicts = _events(run_dir, "hang_verdict")
    assert {(tuple(v["culprits"]), v["reason"]) for v in verdicts} == {((1,), "data_starvation")}
    assert verdicts[0]["detail"].startswith("rank 1 of 2 stuck in data_wait")
    assert "the other 1 wait in collective" in verdicts[0]["detail"]

    def status_names_it() -> bool:
        return "HANG rank 1 of 2 stuck in data_wait (data_starvation)" in _status(run_dir)

    until("stabmon status naming rank 1 of 2", status_names_it, VERDICT_TIMEOUT)


def test_no_stall_and_no_verdict_while_rank_0_checkpoints_or_evaluates_alone_or_all_evaluate(
    tmp_path: Path, processes: Processes
) -> None:
    # One job passes through each phase in turn, as a real loop does: rank 0 checkpoints
    # alone, then evaluates alone, then every rank evaluates, each phase 10 s long.
    run_dir = tmp_path / "runs"
    job = _torchrun(processes, run_dir, "--mode", "checkpoint", "--mode", "eval0",
                    "--mode", "eval", "--stall-seconds", "6", "--phase-seconds", "10",
                    "--after-phase-seconds", "3")  # fmt: skip
    assert job.wait(timeout=240) == 0
    assert job.stdout is not None
    passed = {line for line in job.stdout.read().splitlines() if " passed " in line}
    assert passed == {f"rank {rank} passed {phase}" for rank in range(WORLD)
                      for phase in ("checkpoint", "eval0", "eval")}  # fmt: skip
    assert _events(run_dir, "hang_verdict") == []
    assert len(_events(run_dir, "detach")) == WORLD
    # Rank 0 inside its phase has the phase's limit; the ranks waiting for it in a barrier
    # (10 s, past their 6 s limit) read its record and take the phase's limit too. Their
    # next step takes 3 s: once rank 0 has left its phase they have their own 6 s again,
    # counted from when they last saw it holding, not from their step before the barrier.
    assert [e for e in _events(run_dir, "anomaly") if e["kind"] == "stall"] == []
    assert _events(run_dir, "hang_evidence") == []


def test_a_checkpoint_that_never_ends_is_caught_once_the_phase_limit_passes_and_exit_ends_it(
    tmp_path: Path, processes: Processes
) -> None:
    # One job for two questions: a hang inside a phase is caught by the phase's own limit,
    # and stall_action: exit ends a hung job (it would wait for ever without the action).
    run_dir = tmp_path / "runs"
    # The grace must outlast the spread of the four stalls, the evidence's wait for the flight
    # recorder and a poll of the responder, so every rank's stall and the verdict are written
    # before the first rank exits (and torchrun stops the rest): 8 s leaves seconds to spare.
    job = _torchrun(processes, run_dir, "--mode", "checkpoint-hang", "--phase-limit", "8",
                    "--action", "exit", "--grace", "8")  # fmt: skip
    code = job.wait(timeout=240)
    assert code != 0
    (verdict, *_) = _events(run_dir, "hang_verdict")
    assert verdict["culprits"] == [0]
    assert verdict["reason"] == "collective_not_entered"
    assert verdict["detail"].startswith("rank 0 of 4 stuck in compute")
    stalls = {e["rank"]: e for e in _events(run_dir, "anomaly") if e["kind"] == "stall"}
    assert set(stalls) == {0, 1, 2, 3}
    assert all(e["stacks"] for e in stalls.values())
    # The waiting ranks were held to the phase's limit while rank 0 was within it.
    # (Rank 0's limit runs from its own last step, a few ms before theirs: hence 7.5, which is
    # still far past their own 3 s.)
    assert all(stalls[rank]["silent_seconds"] > 7.5 for rank in (1, 2, 3))
    # The evidence is on disk before the exit: each rank that ended by the action says so.
    exits = _events(run_dir, "stall_exit")
    assert exits and all(e["exit_code"] == 75 for e in exits)
    assert len(_events(run_dir, "hang_evidence")) >= 1
