"""The stall watchdog on a fake clock: limits, edges and the stacks it captures."""

from __future__ import annotations

import threading
import time

import pytest

from stabmon.detectors.stall import (
    Heartbeat,
    PeerPhase,
    StallReport,
    StallWatchdog,
    capture_stacks,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watchdog(
    clock: FakeClock, stall_seconds: float | None = 10.0, phase_stall_seconds: float = 100.0
):  # type: ignore[no-untyped-def]
    heartbeat = Heartbeat(clock)
    stalls: list[StallReport] = []
    recoveries: list[float] = []
    watchdog = StallWatchdog(
        heartbeat,
        stall_seconds=stall_seconds,
        phase_stall_seconds=phase_stall_seconds,
        on_stall=stalls.append,
        on_recover=recoveries.append,
        clock=clock,
    )
    return heartbeat, watchdog, stalls, recoveries


def test_stall_watchdog_fires_once_after_the_limit_and_recovers_once() -> None:
    clock = FakeClock()
    heartbeat, watchdog, stalls, recoveries = _watchdog(clock)
    heartbeat.beat(clock.now, None)
    heartbeat.phase = "data_wait"
    clock.now += 9.0
    watchdog.check()
    assert not stalls
    clock.now += 2.0
    watchdog.check()
    watchdog.check()
    assert len(stalls) == 1 and watchdog.stalled
    assert stalls[0].phase == "data_wait" and stalls[0].silent_seconds == pytest.approx(11.0)
    clock.now += 5.0
    heartbeat.beat(clock.now, 16.0)
    watchdog.check()
    watchdog.check()
    assert recoveries == [pytest.approx(16.0)] and not watchdog.stalled


def test_stall_watchdog_uses_the_phase_limit_before_the_first_step() -> None:
    clock = FakeClock()
    _, watchdog, stalls, _ = _watchdog(clock, stall_seconds=10.0, phase_stall_seconds=100.0)
    clock.now += 50.0
    watchdog.check()
    assert not stalls
    clock.now += 51.0
    watchdog.check()
    assert len(stalls) == 1 and stalls[0].phase == "startup"


def test_stall_watchdog_uses_the_phase_limit_inside_a_named_phase() -> None:
    clock = FakeClock()
    heartbeat, watchdog, stalls, _ = _watchdog(clock)
    heartbeat.beat(clock.now, None)
    heartbeat.phase, heartbeat.named_phase = "eval", True
    clock.now += 60.0
    watchdog.check()
    assert not stalls
    assert watchdog.limit_seconds() == 100.0


def test_automatic_limit_is_ten_median_steps_but_at_least_a_minute() -> None:
    clock = FakeClock()
    heartbeat, watchdog, _, _ = _watchdog(clock, stall_seconds=None)
    heartbeat.beat(clock.now, None)
    assert watchdog.limit_seconds() == 60.0
    for _ in range(10):
        heartbeat.beat(clock.now, 0.5)
    assert watchdog.limit_seconds() == 60.0
    for _ in range(100):
        heartbeat.beat(clock.now, 30.0)
    assert watchdog.limit_seconds() == 300.0


def test_capture_stacks_includes_a_blocked_thread() -> None:
    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="blocked-worker")
    worker.start()
    try:
        time.sleep(0.05)
        stacks = capture_stacks()
        (label,) = [name for name in stacks if name.startswith("blocked-worker")]
        assert any("wait" in line for line in stacks[label])
    finally:
        release.set()
        worker.join()


def _peer_watchdog(clock: FakeClock, holds: list[bool | PeerPhase], asked: list[float]):  # type: ignore[no-untyped-def]
    """``holds[0]``: True, a peer holds a named phase; False, the peer stalled in it."""
    heartbeat = Heartbeat(clock)
    stalls: list[StallReport] = []

    def peer_phase() -> PeerPhase:
        asked.append(clock.now)
        state = holds[0]
        if isinstance(state, PeerPhase):
            return state
        return PeerPhase.HOLDING if state else PeerPhase.STALLED

    watchdog = StallWatchdog(
        heartbeat, stall_seconds=10.0, phase_stall_seconds=100.0, on_stall=stalls.append,
        on_recover=lambda _: None, clock=clock, peer_phase=peer_phase,
    )  # fmt: skip
    heartbeat.beat(clock.now, None)
    heartbeat.phase = "optimizer"
    return watchdog, stalls


def test_stall_watchdog_gives_a_rank_waiting_on_a_peers_phase_that_phases_limit() -> None:
    clock, holds, asked = FakeClock(), [True], []
    watchdog, stalls = _peer_watchdog(clock, holds, asked)
    clock.now += 4.0
    watchdog.check()
    assert asked == []  # within half its own limit the peers' records are not read
    clock.now += 5.0
    watchdog.check()
    assert asked and stalls == [] and watchdog.limit_seconds() == 10.0  # within its own
    clock.now += 80.0  # rank 0 still saves its checkpoint, within the phase's limit
    watchdog.check()
    assert stalls == [] and watchdog.limit_seconds() == 100.0
    clock.now += 12.0  # past the phase limit too: stalled, whatever the peer says
    watchdog.check()
    assert len(stalls) == 1 and stalls[0].limit_seconds == 100.0


def test_stall_watchdog_stalls_at_its_own_limit_once_the_peer_is_past_its_phase() -> None:
    clock, holds, asked = FakeClock(), [True], []
    watchdog, stalls = _peer_watchdog(clock, holds, asked)
    clock.now += 30.0
    watchdog.check()
    assert stalls == []
    holds[0] = False  # the peer stalled in its phase: the waiting rank is hung too
    watchdog.check()
    assert len(stalls) == 1 and stalls[0].limit_seconds == 10.0


def test_stall_watchdog_gives_its_own_limit_again_from_when_the_peer_left_its_phase() -> None:
    clock, asked = FakeClock(), []
    holds: list[bool | PeerPhase] = [True]
    watchdog, stalls = _peer_watchdog(clock, holds, asked)
    clock.now += 40.0  # waiting in a barrier while rank 0 saves
    watchdog.check()
    holds[0] = PeerPhase.NONE  # rank 0 finished; this rank's barrier returns, its step goes on
    clock.now += 1.0
    watchdog.check()
    clock.now += 9.0  # the step after the barrier takes a while: within its own 10 s limit
    watchdog.check()
    assert stalls == []
    clock.now += 1.5  # 10.5 s since it last saw rank 0 holding, and still no step: stalled
    watchdog.check()
    assert len(stalls) == 1 and stalls[0].limit_seconds == 50.0
    assert stalls[0].silent_seconds == 51.5


def test_stall_watchdog_without_a_peer_phase_since_its_last_step_keeps_its_own_limit() -> None:
    clock, asked = FakeClock(), []
    holds: list[bool | PeerPhase] = [True]
    watchdog, stalls = _peer_watchdog(clock, holds, asked)
    clock.now += 20.0
    watchdog.check()  # held
    watchdog._heartbeat.beat(clock.now, 1.0)  # the step ended: the wait is over
    holds[0] = PeerPhase.NONE
    clock.now += 10.5
    watchdog.check()
    assert len(stalls) == 1 and stalls[0].limit_seconds == 10.0


def test_stall_watchdog_gives_its_own_limit_again_after_a_peer_phase_shorter_than_it() -> None:
    clock, asked = FakeClock(), []
    holds: list[bool | PeerPhase] = [True]
    watchdog, stalls = _peer_watchdog(clock, holds, asked)
    clock.now += 6.0  # rank 0 checkpoints for 7 s, less than this rank's 10 s limit
    watchdog.check()
    clock.now += 1.0
    holds[0] = PeerPhase.NONE  # done; this rank's next step takes 8 s more
    clock.now += 7.0
    watchdog.check()
    assert stalls == []  # 14 s since its last step, 8 s since it saw rank 0 holding
    clock.now += 3.0
    watchdog.check()
    assert len(stalls) == 1 and stalls[0].limit_seconds == 16.0
