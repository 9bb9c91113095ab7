"""The training loop's heartbeat, on an injected clock."""

from __future__ import annotations

from stabmon.shared.heartbeat import STARTUP_PHASE, Heartbeat


def test_heartbeat_starts_in_the_startup_phase_at_the_clock_time() -> None:
    heartbeat = Heartbeat(clock=lambda: 42.0)
    assert (heartbeat.last_beat, heartbeat.phase, heartbeat.steps) == (42.0, STARTUP_PHASE, 0)
    assert heartbeat.median_step_seconds() is None


def test_heartbeat_beat_counts_steps_and_progress_only_moves_the_last_beat() -> None:
    heartbeat = Heartbeat(clock=lambda: 0.0)
    heartbeat.beat(1.0, None)
    heartbeat.beat(3.0, 2.0)
    heartbeat.progress(7.0)
    assert (heartbeat.last_beat, heartbeat.steps) == (7.0, 2)
    assert heartbeat.median_step_seconds() == 2.0


def test_heartbeat_median_forgets_steps_older_than_its_ring() -> None:
    heartbeat = Heartbeat(clock=lambda: 0.0)
    for step in range(64):
        heartbeat.beat(float(step), 100.0)  # a slow start-up
    for step in range(64):
        heartbeat.beat(float(64 + step), 1.0)  # then ordinary steps fill the ring
    assert heartbeat.median_step_seconds() == 1.0
    assert heartbeat.steps == 128
