"""stabmon.detectors.leak_rules: the epoch-window and trend leak rules, reconciled.

Host values go in as the readback delivers them (tests/judges.py); the records are read
back from the real event log."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stabmon.shared.heartbeat import Heartbeat
from tests.helpers import LoopClock
from tests.judges import Judges


def test_leak_rules_reports_a_leak_once_when_epoch_memory_keeps_growing(tmp_path: Path) -> None:
    harness = Judges(
        tmp_path,
        leak_rule="epoch_windows",
        leak_window_epochs=1,
        leak_windows=2,
        leak_warmup_epochs=0,
        leak_threshold=0.03,
    )
    memory = 100e6
    for _ in range(8):
        harness.readings.steps += 10
        harness.epoch({"cuda:0": memory}, {"cuda:0": memory})
        memory *= 1.10
    (leak,) = harness.anomalies("memory_leak")
    assert leak["device"] == "cuda:0"
    assert harness.readings.memory_leak_suspected == {"cuda:0": 1}
    epochs = harness.records("epoch")
    assert [r["epoch"] for r in epochs] == list(range(8))
    assert [r["step"] for r in epochs] == [9, 19, 29, 39, 49, 59, 69, 79]
    assert harness.readings.epoch == 8


def test_leak_rules_reports_no_leak_while_epoch_memory_stays_flat(tmp_path: Path) -> None:
    harness = Judges(
        tmp_path,
        leak_rule="epoch_windows",
        leak_window_epochs=1,
        leak_windows=2,
        leak_warmup_epochs=0,
    )
    for _ in range(8):
        harness.epoch({"cuda:0": 100e6}, {"cuda:0": 100e6})
    assert harness.anomalies("memory_leak") == []
    assert harness.readings.memory_leak_suspected == {"cuda:0": 0}


# --- the trend rule in time: latency stated in seconds, whatever the step time ---------------

MIB = 2**20


class _Memory:
    """The Memory port (stabmon.extension.Memory): host RSS as a function of loop time, with
    RSS-like noise (upward excursions of up to 1%, jitter of 0.1%)."""

    def __init__(self, clock: LoopClock, level: Callable[[float], float], seed: int) -> None:
        self.clock, self.level, self.rng = clock, level, random.Random(seed)

    def trend_samples(self) -> dict[str, float]:
        noise = 1 + self.rng.uniform(0, 0.01) + self.rng.gauss(0, 0.001)
        return {"host": self.level(self.clock.now) * noise}

    def limits(self) -> dict[str, float]:
        return {"host": 64 * 2**30}


def _run(
    tmp_path: Path, level: Callable[[float], float], *, step_seconds: float, seconds: float,
    seed: int = 0, **overrides: Any,
) -> tuple[Judges, list[float]]:  # fmt: skip
    """A loop of ``step_seconds`` steps for ``seconds`` of loop time, its step ends driving the
    plug-ins as the Monitor's do (heartbeat beat, then step_end when due); each step's end."""
    clock = LoopClock(start=0.0)
    heartbeat = Heartbeat(clock)
    harness = Judges(tmp_path, memory=_Memory(clock, level, seed), heartbeat=heartbeat,
                     **overrides)  # fmt: skip
    plugged, readings, ends = harness.plugged, harness.readings, []
    while clock.now < seconds:
        clock.advance(step_seconds)
        heartbeat.beat(clock.now, step_seconds)
        readings.steps += 1
        ends.append(clock.now)
        if readings.steps >= plugged.next_step:
            plugged.step_end(readings.steps)
    return harness, ends


def _leak_at(harness: Judges, ends: list[float]) -> float | None:
    """Loop time of the first memory_leak (its step's end), or None."""
    leaks = harness.anomalies("memory_leak")
    return None if not leaks else ends[leaks[0]["step"]]


@pytest.mark.parametrize("step_seconds", [0.05, 0.5, 2.0, 10.0])
def test_a_leak_of_five_percent_an_hour_is_flagged_within_90_minutes_at_any_step_time(
    tmp_path: Path, step_seconds: float
) -> None:
    start = 1800.0  # half an hour flat, then +5% of the level an hour

    def level(now: float) -> float:
        return 2048 * MIB * (1 + 0.05 * max(0.0, now - start) / 3600)

    harness, ends = _run(tmp_path, level, step_seconds=step_seconds, seconds=start + 2 * 3600)
    found = _leak_at(harness, ends)
    assert found is not None and start < found <= start + 90 * 60
    assert harness.anomalies("memory_leak")[0]["device"] == "host"


@pytest.mark.parametrize("step_seconds", [0.05, 0.5, 2.0, 10.0])
def test_a_leak_that_doubles_memory_in_ten_minutes_is_flagged_within_three(
    tmp_path: Path, step_seconds: float
) -> None:
    start = 600.0

    def level(now: float) -> float:
        return 1024 * MIB * 2 ** (max(0.0, now - start) / 600)

    harness, ends = _run(tmp_path, level, step_seconds=step_seconds, seconds=start + 900)
    found = _leak_at(harness, ends)
    assert found is not None and start < found <= start + 180


@pytest.mark.parametrize("step_seconds", [0.05, 0.5, 2.0, 10.0])
def test_flat_memory_with_rss_noise_stays_quiet_for_six_hours(
    tmp_path: Path, step_seconds: float
) -> None:
    harness, _ = _run(tmp_path, lambda now: 2048 * MIB, step_seconds=step_seconds,
                      seconds=6 * 3600, seed=3)  # fmt: skip
    assert harness.anomalies("memory_leak") == []


def test_a_short_run_whose_memory_grows_unmistakably_is_flagged_before_it_ends(
    tmp_path: Path,
) -> None:
    """A VAE's leak: +10% of RSS over 300 steps of 0.05 s (15 s: no time scale fills)."""
    harness, ends = _run(tmp_path, lambda now: 900 * MIB * (1 + 0.1 * now / 15.0),
                         step_seconds=0.05, seconds=15.0)  # fmt: skip
    (leak,) = harness.anomalies("memory_leak")
    assert leak["scale"] == "short" and leak["step"] < 300


def test_a_warm_up_that_flattens_is_no_leak_in_a_short_run(tmp_path: Path) -> None:
    """+30% over the first 60 steps (caches, the optimizer's state), flat for 440 more."""
    harness, _ = _run(tmp_path, lambda now: 900 * MIB * (1 + 0.3 * min(now, 3.0) / 3.0),
                      step_seconds=0.05, seconds=25.0)  # fmt: skip
    assert harness.anomalies("memory_leak") == []
