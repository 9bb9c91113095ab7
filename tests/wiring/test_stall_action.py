"""The stall responder on an injected clock: evidence, verdict over the node's records, actions."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from stabmon.config import Config
from stabmon.detectors.stall import Heartbeat, StallReport
from stabmon.export.event_log import EventLog
from stabmon.pipeline.readings import Readings
from stabmon.pipeline.recorder import Recorder
from stabmon.probes.collectives import CollectiveCounter
from stabmon.probes.flight_recorder import FlightRecorder
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter
from stabmon.shared.own_record import Registration
from stabmon.shared.rundir import ProcessRecord, RunPaths, write_atomic
from stabmon.wiring.stall_action import STALL_EXIT_CODE, StallResponder


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Ended(Exception):
    pass


def _responder(
    tmp_path: Path,
    action: str,
    clock: Clock,
    exits: list[int],
    flight: FlightRecorder | None = None,
) -> StallResponder:
    paths = RunPaths(root=tmp_path, run_id="job", rank=1)
    paths.run_directory.mkdir(parents=True)
    guard = Guard(LogLimiter())
    events = EventLog(paths.events, common={"run": "job", "rank": 1}, guard=guard)
    recorder = Recorder(Config(), Readings(labels={"rank": "1", "run": "job"}), events=events,
                        limiter=LogLimiter())  # fmt: skip
    record = ProcessRecord(pid=os.getpid(), create_time=0.0, run="job", rank=1)
    registration = Registration(tmp_path, paths.record, record)
    return StallResponder(
        action=action, grace_seconds=30.0, rank=1, run="job", recorder=recorder,
        heartbeat=Heartbeat(clock), collectives=CollectiveCounter(modules=()),
        registration=registration, run_directory=paths.run_directory, root=tmp_path,
        clock=clock, end_process=exits.append,
        flight_recorder=flight if flight is not None else FlightRecorder(lambda: {}),
    )  # fmt: skip


def _report(stack: list[str]) -> StallReport:
    import threading

    key = f"MainThread ({threading.main_thread().ident})"
    return StallReport(phase="backward", silent_seconds=5.0, limit_seconds=3.0, steps=4,
                       stacks={key: stack})  # fmt: skip


SLEEPING = ['  File "/job/train.py", line 77, in step\n    time.sleep(3600)']


def _events(tmp_path: Path, event: str) -> list[dict[str, object]]:
    path = tmp_path / "job" / "rank-1.events.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [record for record in records if record["event"] == event]


def _peer(tmp_path: Path, rank: int, state: str) -> None:
    record = ProcessRecord(pid=os.getpid(), create_time=0.0, run="job", rank=rank,
                           hang_state=state, hang_where="c10d_logger.py:81 in wrapper")  # fmt: skip
    write_atomic(tmp_path / "job" / f"rank-{rank}.json", record.to_json())


def test_stall_responder_records_evidence_and_names_the_culprit_from_the_node_records(
    tmp_path: Path,
) -> None:
    clock, exits = Clock(), []
    responder = _responder(tmp_path, "none", clock, exits)
    for rank in (0, 2, 3):
        _peer(tmp_path, rank, "collective")
    responder.stalled(_report(SLEEPING))
    (evidence,) = _events(tmp_path, "hang_evidence")
    assert (evidence["state"], evidence["where"]) == ("compute", "train.py:77 in step")
    responder.poll()
    responder.poll()  # the same verdict is written once
    (verdict,) = _events(tmp_path, "hang_verdict")
    assert (verdict["culprits"], verdict["reason"]) == ([1], "collective_not_entered")
    assert exits == []


@pytest.mark.skipif(os.geteuid() != 0, reason="Requires: root, to give a record to another uid")
def test_node_verdict_ignores_records_another_local_user_wrote(tmp_path: Path) -> None:
    import pwd

    clock, exits = Clock(), []
    responder = _responder(tmp_path, "none", clock, exits)
    for rank in (0, 2, 3):
        _peer(tmp_path, rank, "collective")
    os.chown(tmp_path / "job" / "rank-3.json", pwd.getpwnam("nobody").pw_uid, -1)
    responder.stalled(_report(SLEEPING))
    verdict = responder.node_verdict()
    # Ranks 0-2 are ours; rank 3's record is someone else's and names no one.
    assert verdict is not None and 3 not in verdict.culprits and verdict.world == 3


def test_stall_action_exit_ends_the_process_after_the_grace_period_only(tmp_path: Path) -> None:
    clock, exits = Clock(), []
    responder = _responder(tmp_path, "exit", clock, exits)
    responder.stalled(_report(SLEEPING))
    clock.now += 29.0
    responder.poll()
    assert exits == []
    clock.now += 2.0
    responder.poll()
    assert exits == [STALL_EXIT_CODE]
    (record,) = _events(tmp_path, "stall_exit")
    assert record["exit_code"] == 75


def test_stall_action_exit_is_cancelled_when_a_step_completes_in_the_grace_period(
    tmp_path: Path,
) -> None:
    clock, exits = Clock(), []
    responder = _responder(tmp_path, "exit", clock, exits)
    responder.stalled(_report(SLEEPING))
    responder.resumed(10.0)
    clock.now += 60.0
    responder.poll()
    assert exits == []
    assert responder.state is None


def test_stall_action_dump_writes_the_stacks_beside_the_event_log(tmp_path: Path) -> None:
    responder = _responder(tmp_path, "dump", Clock(), [])
    responder.stalled(_report(SLEEPING))
    text = (tmp_path / "job" / "rank-1.stall.txt").read_text()
    assert "state compute at train.py:77 in step" in text
    assert "time.sleep(3600)" in text


def test_collective_counter_counts_calls_once_and_knows_the_one_in_progress() -> None:
    import types

    seen: list[str | None] = []
    counter = CollectiveCounter(modules=())
    module = types.ModuleType("fake_distributed")

    def barrier() -> None:
        seen.append(counter.current)

    def all_gather_object() -> None:
        module.barrier()  # nested, through the module global as c10d does

    module.barrier = barrier  # type: ignore[attr-defined]
    module.all_gather_object = all_gather_object  # type: ignore[attr-defined]
    counter = CollectiveCounter(modules=(module,))
    counter.install()
    module.barrier()
    module.all_gather_object()
    assert (counter.issued, seen, counter.current) == (2, ["barrier", "all_gather_object"], None)
    counter.uninstall()
    assert module.barrier is barrier


@pytest.mark.skipif(not dist.is_available(), reason="Requires: torch.distributed")
def test_collective_counter_counts_a_real_gloo_all_reduce(tmp_path: Path) -> None:
    import torch

    original = dist.all_reduce
    counter = CollectiveCounter()
    counter.install()
    try:
        store = dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        dist.all_reduce(torch.ones(2))
        dist.barrier()
        assert counter.issued == 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        counter.uninstall()
    assert dist.all_reduce is original


def test_stall_action_raise_raises_training_stalled_in_the_main_thread(tmp_path: Path) -> None:
    import threading

    from stabmon import TrainingStalled

    responder = _responder(tmp_path, "raise", Clock(), [])
    watchdog = threading.Thread(target=responder.stalled, args=(_report(SLEEPING),))
    with pytest.raises(TrainingStalled, match="stall_action: raise"):
        watchdog.start()
        for _ in range(3000):  # bounded: a broken raise fails the test instead of hanging it
            threading.Event().wait(0.01)
    watchdog.join(timeout=30)


def test_stall_action_rejects_an_unknown_action_with_the_allowed_ones() -> None:
    from stabmon import ConfigError, load_config

    with pytest.raises(ConfigError, match="stall_action.*none.*dump.*raise.*exit"):
        load_config(overrides={"stall_action": "kill"})


def test_stall_responder_records_the_flight_recorders_numbers_and_judges_by_them(
    tmp_path: Path,
) -> None:
    # A recorded-shaped NCCL status (no GPU here): this rank enqueued one collective fewer.
    status = {"pg_status": {"0": {"last_enqueued_collective": 811,
                                  "last_started_collective": -1,
                                  "last_completed_collective": 811}}}  # fmt: skip
    clock, exits = Clock(), []
    responder = _responder(tmp_path, "none", clock, exits, FlightRecorder(lambda: status))
    for rank in (0, 2, 3):
        record = ProcessRecord(pid=os.getpid(), create_time=0.0, run="job", rank=rank,
                               hang_state="compute", flight=(812, -1, 811))  # fmt: skip
        write_atomic(tmp_path / "job" / f"rank-{rank}.json", record.to_json())
    responder.stalled(_report(SLEEPING))
    (evidence,) = _events(tmp_path, "hang_evidence")
    assert evidence["flight"] == [811, -1, 811]
    verdict = responder.node_verdict()
    assert verdict is not None and (verdict.culprits, verdict.reason) == (
        (1,), "collective_not_entered")  # fmt: skip


def test_stall_responder_records_evidence_when_the_flight_recorder_fails(tmp_path: Path) -> None:
    def broken() -> bytes:
        raise RuntimeError("NCCL trace buffer disabled")

    clock, exits = Clock(), []
    responder = _responder(tmp_path, "none", clock, exits, FlightRecorder(broken))
    responder.stalled(_report(SLEEPING))
    (evidence,) = _events(tmp_path, "hang_evidence")
    assert evidence["flight"] is None and evidence["state"] == "compute"


@pytest.mark.parametrize("blocks_from_read", [1, 2], ids=["at-the-stall", "while-stalled"])
def test_stall_action_exit_fires_while_the_flight_recorder_read_blocks_forever(
    tmp_path: Path, blocks_from_read: int
) -> None:
    # The blocking dump stands in for NCCL's, whose C++ lock a hung collective holds
    # (NCCL cannot run here); it blocks until the test ends, as if for ever.
    release, reads = threading.Event(), []

    def hung_dump() -> dict[str, object]:
        reads.append(1)
        if len(reads) >= blocks_from_read:
            release.wait()
        return {}

    clock, exits = Clock(), []
    responder = _responder(tmp_path, "exit", clock, exits, FlightRecorder(hung_dump))

    def stall_then_poll_past_the_grace_period() -> None:
        responder.stalled(_report(SLEEPING))
        clock.now += 31.0  # past the grace period, and a new flight read is due
        responder.poll()

    loop = threading.Thread(target=stall_then_poll_past_the_grace_period, daemon=True)
    loop.start()
    loop.join(timeout=60)  # a bound for the broken case only: the fixed one never waits on it
    try:
        assert exits == [STALL_EXIT_CODE]
    finally:
        release.set()


# Attaches on a clock it moves itself, stalls past the limit, then moves the clock through the
# whole grace period and blocks: only the injected clock can end it within the minute.
_ON_THE_LOOP_CLOCK = """
import sys, time
import torch, stabmon
from stabmon.export.families import registry_sum

class Clock:
    now = 1000.0
    def __call__(self):
        return self.now

clock = Clock()
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
monitor = stabmon.attach(model, optimizer, port=0, address="127.0.0.1", run_dir=sys.argv[1],
                         run_id="job", stall_seconds=2, stall_action="exit",
                         stall_grace_seconds=3600, clock=clock)
for _ in range(3):
    loss = model(torch.randn(4, 2)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    monitor.observe(loss=loss)
clock.now += 10.0  # past the stall limit
deadline = time.monotonic() + 60
while registry_sum(monitor.registry, "stabmon_stalled") < 1 and time.monotonic() < deadline:
    time.sleep(0.02)
print("stalled", flush=True)
for _ in range(600):  # the grace period passes on the loop clock only, again and again
    clock.now += 3601.0
    time.sleep(0.1)
print("still alive", flush=True)
"""


def test_stall_action_exit_counts_its_grace_period_on_the_injected_loop_clock(
    tmp_path: Path,
) -> None:
    # A real process: the exit ends it. The responder's timers (grace period, node-records
    # cache, flight-read interval) read the clock attach() was given, not time.monotonic.
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    process = subprocess.run([sys.executable, "-c", _ON_THE_LOOP_CLOCK, str(tmp_path)], env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert process.stdout.splitlines() == ["stalled"], process.stderr[-2000:]
    assert process.returncode == STALL_EXIT_CODE, process.stderr[-2000:]
    lines = (tmp_path / "job" / "rank-0.events.jsonl").read_text().splitlines()
    (record,) = [r for r in map(json.loads, lines) if r["event"] == "stall_exit"]
    assert record["grace_seconds"] == 3600
