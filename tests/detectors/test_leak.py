import json
import math
import random
from typing import Any

import pytest

from stabmon.detectors.leak import LeakDetector, LeakVerdict

GIB = 2.0**30


def _detector(*, warmup_epochs: int = 2) -> LeakDetector:
    # One team's rule: memory grows more than 3% in three consecutive 10-epoch windows.
    return LeakDetector(threshold=0.03, windows=3, window_epochs=10, warmup_epochs=warmup_epochs)


def _run(detector: LeakDetector, samples: list[tuple[int, float]]) -> list[LeakVerdict]:
    return [detector.update(epoch, value) for epoch, value in samples]


def _growing(epochs: range, rate: float = 0.01) -> list[tuple[int, float]]:
    return [(epoch, GIB * (1.0 + rate) ** epoch) for epoch in epochs]


def test_leak_detector_fires_on_steady_1_percent_growth_when_the_third_window_closes() -> None:
    verdicts = _run(_detector(warmup_epochs=2), _growing(range(45)))

    # Baseline at epoch 2; windows close at epochs 12, 22 and 32, each grown 1.01**10 - 1 = 10.5%.
    assert [epoch for epoch, v in enumerate(verdicts) if v.newly_suspected] == [32]
    assert not any(v.suspected for v in verdicts[:32])
    assert all(v.suspected for v in verdicts[32:])
    assert verdicts[32].growing_windows == 3
    assert verdicts[32].window_growth == pytest.approx(1.01**10 - 1)
    assert verdicts[32].drift == pytest.approx(1.01**30 - 1)
    assert verdicts[42].growing_windows == 4


def test_leak_detector_stays_quiet_during_warmup_growth() -> None:
    warmup = [(0, 1 * GIB), (1, 4 * GIB), (2, 8 * GIB), (3, 16 * GIB), (4, 30 * GIB)]
    flat = [(epoch, 30 * GIB) for epoch in range(5, 100)]
    detector = _detector(warmup_epochs=5)

    verdicts = _run(detector, warmup + flat)

    assert not any(v.suspected for v in verdicts)
    assert [v.drift for v in verdicts[:5]] == [None] * 5
    assert all(v.drift == 0.0 for v in verdicts[5:])
    assert detector.baseline == 30 * GIB


def test_leak_detector_stays_quiet_on_a_flat_series_with_half_percent_noise() -> None:
    rng = random.Random(0)
    samples = [(epoch, GIB * (1.0 + rng.uniform(-0.005, 0.005))) for epoch in range(200)]

    verdicts = _run(_detector(), samples)

    assert not any(v.suspected for v in verdicts)
    assert max(v.growing_windows for v in verdicts) == 0


@pytest.mark.parametrize("growing_windows", [1, 2])
def test_leak_detector_stays_quiet_on_growth_that_plateaus(growing_windows: int) -> None:
    # Allocator caching: memory grows to its working set, then stays there.
    growth_epochs = 10 * growing_windows
    samples = _growing(range(growth_epochs + 1), rate=0.02)
    plateau = samples[-1][1]
    samples += [(epoch, plateau) for epoch in range(growth_epochs + 1, 200)]

    verdicts = _run(_detector(warmup_epochs=0), samples)

    assert not any(v.suspected for v in verdicts)
    assert max(v.growing_windows for v in verdicts) == growing_windows


def test_leak_detector_reports_exact_drift_against_the_baseline() -> None:
    detector = _detector(warmup_epochs=2)
    samples = [(0, 100.0), (1, 500.0), (2, 200.0), (3, 210.0), (4, 190.0), (5, 250.0), (6, 0.0)]

    drifts = [v.drift for v in _run(detector, samples)]

    assert drifts == [None, None, 0.0, pytest.approx(0.05), pytest.approx(-0.05), 0.25, -1.0]
    assert detector.baseline == 200.0


def test_leak_detector_drops_suspicion_when_a_window_stops_growing() -> None:
    detector = _detector(warmup_epochs=0)
    samples = _growing(range(31))
    plateau = samples[-1][1]
    samples += [(epoch, plateau) for epoch in range(31, 41)]

    verdicts = _run(detector, samples)

    # Windows close at 10, 20 and 30 (growing), then at 40 (flat).
    assert verdicts[30].newly_suspected
    assert all(v.suspected and not v.newly_suspected for v in verdicts[31:40])
    assert verdicts[40].window_growth == 0.0
    assert verdicts[40].growing_windows == 0
    assert not verdicts[40].suspected
    assert not verdicts[40].newly_suspected


def test_leak_detector_closes_windows_at_the_first_sample_past_a_skipped_epoch() -> None:
    detector = LeakDetector(threshold=0.03, windows=3, window_epochs=10, warmup_epochs=0)
    samples = [(0, 100.0), (4, 101.0), (8, 102.0), (13, 110.0), (19, 111.0), (25, 121.0)]

    growths = [v.window_growth for v in _run(detector, samples)]

    # First window 0 -> 13 (+10%); the second starts at 13 and closes at 25 (+10%).
    assert growths == [None, None, None, pytest.approx(0.10), None, pytest.approx(0.10)]


def test_leak_detector_never_suspects_with_a_zero_baseline() -> None:
    samples = [(0, 0.0)] + _growing(range(1, 100), rate=0.05)

    verdicts = _run(_detector(warmup_epochs=0), samples)

    assert not any(v.suspected for v in verdicts)
    assert all(v.drift is None and v.window_growth is None for v in verdicts)


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_leak_detector_ignores_non_finite_and_negative_values(value: float) -> None:
    detector = _detector(warmup_epochs=0)
    verdicts = _run(detector, _growing(range(30)))
    before = detector.state_dict()

    verdict = detector.update(30, value)

    assert verdict == LeakVerdict(
        drift=None,
        window_growth=None,
        growing_windows=verdicts[-1].growing_windows,
        suspected=verdicts[-1].suspected,
        newly_suspected=False,
    )
    assert detector.state_dict() == before


def test_leak_detector_has_no_baseline_before_warmup_ends() -> None:
    detector = _detector(warmup_epochs=3)
    _run(detector, [(0, GIB), (1, GIB), (2, GIB)])

    assert detector.baseline is None


@pytest.mark.parametrize("split", [1, 2, 7, 12, 25, 33])
def test_leak_detector_continues_identically_after_a_state_dict_round_trip(split: int) -> None:
    samples = _growing(range(60))
    uninterrupted = _detector()
    expected = _run(uninterrupted, samples)

    first = _detector()
    head = _run(first, samples[:split])
    resumed = _detector()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    tail = _run(resumed, samples[split:])

    assert head + tail == expected
    assert resumed.state_dict() == uninterrupted.state_dict()


@pytest.mark.parametrize(
    ("threshold", "windows", "window_epochs", "warmup_epochs", "match"),
    [
        (0.0, 3, 10, 2, r"threshold must be a relative growth > 0 .*got 0\.0"),
        (math.nan, 3, 10, 2, r"threshold must be a relative growth > 0 .*got nan"),
        (0.03, 0, 10, 2, r"windows must be a number of consecutive windows >= 1, got 0"),
        (0.03, 3, 0, 2, r"window_epochs must be a number of epochs >= 1, got 0"),
        (0.03, 3, 10, -1, r"warmup_epochs must be a number of epochs >= 0, got -1"),
    ],
)
def test_leak_detector_rejects_bad_constructor_arguments(
    threshold: float, windows: int, window_epochs: int, warmup_epochs: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        LeakDetector(
            threshold=threshold,
            windows=windows,
            window_epochs=window_epochs,
            warmup_epochs=warmup_epochs,
        )


_GOOD_STATE = {
    "baseline": 100.0,
    "window_start_epoch": 10,
    "window_start_value": 110.0,
    "growing_windows": 1,
}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"baseline": -1.0}, r"'baseline' must be None or a finite number >= 0, got -1\.0"),
        ({"baseline": math.inf}, r"'baseline' must be None or a finite number >= 0, got inf"),
        ({"window_start_epoch": 1.5}, r"'window_start_epoch' must be an integer, got 1\.5"),
        ({"window_start_value": None}, r"'window_start_value' must be a finite number >= 0"),
        ({"growing_windows": -1}, r"'growing_windows' must be an integer >= 0, got -1"),
        ({"growing_windows": True}, r"'growing_windows' must be an integer >= 0, got True"),
        ({"suspected": True}, r"exactly the keys \['baseline', 'growing_windows', "),
    ],
)
def test_leak_detector_rejects_a_malformed_state_and_keeps_its_own(
    changes: dict[str, Any], match: str
) -> None:
    detector = _detector()
    _run(detector, _growing(range(15)))
    before = detector.state_dict()

    with pytest.raises(ValueError, match=match):
        detector.load_state_dict(_GOOD_STATE | changes)

    assert detector.state_dict() == before


def test_leak_detector_rejects_a_state_with_a_missing_key() -> None:
    state = {key: value for key, value in _GOOD_STATE.items() if key != "baseline"}

    with pytest.raises(ValueError, match=r"exactly the keys .*got \['growing_windows', "):
        _detector().load_state_dict(state)
