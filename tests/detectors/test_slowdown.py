"""The slowdown rule on synthetic blocks: a fake loop clock, no sleeping, milliseconds each."""

from __future__ import annotations

import random

import pytest

from stabmon.detectors.slowdown import Block, Slowdown, SlowdownDetector

PACE = {"data_wait": 0.02, "forward": 0.03, "backward": 0.04, "optimizer": 0.01}  # 0.1 s a step
HOLD = 300.0
BLOCK = 10.0


def detector() -> SlowdownDetector:
    return SlowdownDetector(threshold=0.1, hold_seconds=HOLD, baseline_seconds=600.0)


def run(
    steps: int,
    pace: dict[str, float] | None = None,
    *,
    slow_from: int | None = None,
    slower: dict[str, float] | None = None,
    jitter: float = 0.0,
    seed: int = 0,
) -> list[tuple[float, Slowdown]]:
    """Step by step on a fake clock, closing a block every BLOCK seconds as the Monitor does."""
    rng = random.Random(seed)
    found: list[tuple[float, Slowdown]] = []
    judge = detector()
    now, due = 0.0, BLOCK
    block_steps, spent = 0, dict.fromkeys(PACE, 0.0)
    for step in range(steps):
        this = dict(slower if slow_from is not None and step >= slow_from and slower else PACE)
        if pace is not None:
            this = pace
        for phase, seconds in this.items():
            took = seconds * (1.0 + rng.uniform(-jitter, jitter))
            spent[phase] += took
            now += took
        block_steps += 1
        if now >= due:
            result = judge.update(Block(now, block_steps, spent))
            if result is not None:
                found.append((now, result))
            block_steps, spent, due = 0, dict.fromkeys(PACE, 0.0), now + BLOCK
    return found


def test_slowdown_detector_names_data_wait_when_the_input_pipeline_slows_by_20_percent() -> None:
    onset = 3000  # steps at 0.1 s: 300 s of baseline pace first
    slower = {**PACE, "data_wait": PACE["data_wait"] + 0.02}  # +20% per step

    found = run(onset + 4000, slow_from=onset, slower=slower, jitter=0.05)

    [(at, slowdown)] = found
    assert slowdown.phase == "data_wait"
    assert slowdown.ratio == pytest.approx(1.2, abs=0.03)
    started = onset * 0.1  # the fake clock at the onset (jitter averages out)
    assert started + HOLD <= at <= started + HOLD + 2 * BLOCK + 5.0


def test_slowdown_detector_names_forward_when_compute_slows() -> None:
    slower = {**PACE, "forward": PACE["forward"] + 0.02}

    found = run(7000, slow_from=3000, slower=slower, jitter=0.05)

    assert [slowdown.phase for _, slowdown in found] == ["forward"]


def test_slowdown_detector_stays_quiet_over_a_clean_20000_step_run_with_noise() -> None:
    rng = random.Random(7)
    judge = detector()
    now = 0.0
    found = []
    for index in range(20_000 // 100):  # blocks of 100 steps, ~10 s each
        steps = 100
        spent = {
            phase: seconds * steps * rng.uniform(0.95, 1.05) for phase, seconds in PACE.items()
        }
        if index % 25 == 0:  # an epoch start: the loader's workers spin up, one slow block
            spent["data_wait"] += 8.0
        if index == 120:  # one 60 s step (a garbage collection, a checkpoint written inline)
            spent["optimizer"] += 60.0
        now += sum(spent.values())
        result = judge.update(Block(now, steps, spent))
        if result is not None:
            found.append(result)

    assert found == []


def test_slowdown_detector_ignores_a_slow_stretch_shorter_than_the_hold_time() -> None:
    slower = {**PACE, "forward": PACE["forward"] + 0.05}
    judge = detector()
    now = 0.0
    results = []
    for block in range(200):
        pace = slower if 60 <= block < 80 else PACE  # 20 blocks: ~300 s at 1.5x, just under hold
        spent = {phase: seconds * 60 for phase, seconds in pace.items()}
        now += sum(spent.values())
        results.append(judge.update(Block(now, 60, spent)))

    assert [r for r in results if r is not None] == []


def test_slowdown_detector_reports_one_anomaly_per_episode_and_rearms_after_recovery() -> None:
    slower = {**PACE, "backward": PACE["backward"] + 0.03}
    judge = detector()
    now = 0.0
    found = []
    for block in range(400):
        pace = slower if 60 <= block < 120 or 250 <= block < 320 else PACE
        spent = {phase: seconds * 100 for phase, seconds in pace.items()}
        now += sum(spent.values())
        result = judge.update(Block(now, 100, spent))
        if result is not None:
            found.append(result.phase)

    assert found == ["backward", "backward"]


def test_slowdown_detector_judges_nothing_before_it_has_a_baseline() -> None:
    judge = detector()
    spent = {phase: seconds * 100 for phase, seconds in PACE.items()}

    for block in range(5):
        judge.update(Block(10.0 * (block + 1), 100, spent))

    assert judge.baseline_seconds is None


def test_slowdown_detector_forgets_its_baseline_on_reset() -> None:
    judge = detector()
    spent = {phase: seconds * 100 for phase, seconds in PACE.items()}
    for block in range(10):
        judge.update(Block(10.0 * (block + 1), 100, spent))
    assert judge.baseline_seconds == pytest.approx(0.1)

    judge.reset()

    assert judge.baseline_seconds is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 0.0, "hold_seconds": 1.0, "baseline_seconds": 1.0}, "threshold must be"),
        ({"threshold": 0.1, "hold_seconds": -1.0, "baseline_seconds": 1.0}, "hold_seconds and"),
    ],
)
def test_slowdown_detector_rejects_bad_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SlowdownDetector(**kwargs)


def test_slowdown_detector_adopts_a_slow_pace_held_for_the_baseline_span() -> None:
    slower = {**PACE, "forward": PACE["forward"] + 0.03}
    judge = detector()
    now = 0.0
    found, active = [], []
    for block in range(300):
        pace = slower if block >= 60 else PACE
        spent = {phase: seconds * 100 for phase, seconds in pace.items()}
        now += sum(spent.values())
        result = judge.update(Block(now, 100, spent))
        if result is not None:
            found.append(result.phase)
        active.append(judge.active is not None)

    assert found == ["forward"]  # once, not again when the new pace is the baseline
    assert active[-1] is False
    assert judge.baseline_seconds == pytest.approx(0.13)


def test_slowdown_detector_names_the_phase_from_device_times_when_a_block_carries_them() -> None:
    # A sync-free CUDA loop: the GPU's forward slows, but the host waits for it in data_wait
    # (its next pinned-memory copy), so host phases would blame the input pipeline.
    judge = detector()
    now = 0.0
    found = []
    for block in range(120):
        slow = block >= 40
        host = {**PACE, "data_wait": PACE["data_wait"] + (0.03 if slow else 0.0)}
        device = {**PACE, "forward": PACE["forward"] + (0.03 if slow else 0.0)}
        spent = {phase: seconds * 100 for phase, seconds in host.items()}
        now += sum(spent.values())
        cause = {phase: seconds * 100 for phase, seconds in device.items()}
        result = judge.update(Block(now, 100, spent, cause))
        if result is not None:
            found.append(result.phase)

    assert found == ["forward"]
