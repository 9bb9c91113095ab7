import json
import math
import random
from typing import Any

import pytest

from stabmon.detectors.spike import Spike, SpikeDetector


def _detector(*, log_scale: bool = False) -> SpikeDetector:
    return SpikeDetector(threshold=6.0, warmup=100, alpha=0.01, log_scale=log_scale)


def _noisy_loss(rng: random.Random, steps: int) -> list[float]:
    return [2.0 + rng.gauss(0.0, 0.05) for _ in range(steps)]


def _spikes(detector: SpikeDetector, series: list[float]) -> list[Spike]:
    return [spike for value in series if (spike := detector.update(value)) is not None]


def test_spike_detector_stays_quiet_during_warmup_even_for_a_huge_value() -> None:
    detector = SpikeDetector(threshold=6.0, warmup=20, alpha=0.05)

    verdicts = [detector.update(1.0) for _ in range(19)] + [detector.update(1e6)]

    assert verdicts == [None] * 20
    assert detector.count == 20


def test_spike_detector_flags_a_10x_loss_spike_after_a_noisy_stable_series() -> None:
    detector = _detector()
    assert _spikes(detector, _noisy_loss(random.Random(0), 500)) == []

    spike = detector.update(20.0)

    assert spike is not None
    assert spike.value == 20.0
    assert spike.zscore > 6.0
    assert spike.mean == pytest.approx(2.0, abs=0.02)


def test_spike_detector_ignores_a_downward_spike() -> None:
    detector = _detector()
    _spikes(detector, _noisy_loss(random.Random(0), 500))

    assert detector.update(0.01) is None


def test_spike_detector_does_not_flag_a_slowly_decreasing_loss_curve() -> None:
    rng = random.Random(0)
    curve = [2.0 * math.exp(-t / 500) * (1.0 + 0.02 * rng.gauss(0.0, 1.0)) for t in range(3000)]

    assert _spikes(_detector(), curve) == []


def test_spike_detector_has_no_false_positives_on_10000_noisy_stable_samples() -> None:
    assert _spikes(_detector(), _noisy_loss(random.Random(0), 10_000)) == []


def test_spike_detector_in_log_scale_flags_a_100x_grad_norm_jump() -> None:
    rng = random.Random(0)
    norms = [math.exp(rng.gauss(0.0, 0.1)) for _ in range(500)]
    detector = _detector(log_scale=True)
    assert _spikes(detector, norms) == []

    spike = detector.update(100.0)

    assert spike is not None
    assert spike.mean == pytest.approx(1.0, rel=0.05)


def test_spike_detector_in_log_scale_does_not_flag_a_smooth_2x_drift() -> None:
    rng = random.Random(0)
    norms = [2.0 ** (t / 1000) * (1.0 + 0.01 * rng.gauss(0.0, 1.0)) for t in range(1000)]

    assert _spikes(_detector(log_scale=True), norms) == []


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_spike_detector_ignores_non_finite_values_without_changing_state(value: float) -> None:
    detector = _detector()
    _spikes(detector, _noisy_loss(random.Random(0), 200))
    before = detector.state_dict()

    assert detector.update(value) is None
    assert detector.state_dict() == before


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_spike_detector_in_log_scale_ignores_non_positive_values(value: float) -> None:
    detector = _detector(log_scale=True)
    _spikes(detector, [1.0, 2.0, 3.0])
    before = detector.state_dict()

    assert detector.update(value) is None
    assert detector.state_dict() == before


def test_spike_detector_still_flags_a_second_spike_10_steps_after_the_first() -> None:
    rng = random.Random(0)
    detector = _detector()
    _spikes(detector, _noisy_loss(rng, 500))

    first = detector.update(20.0)
    between = _spikes(detector, _noisy_loss(rng, 9))
    second = detector.update(20.0)

    assert first is not None
    assert between == []
    assert second is not None


def test_spike_detector_follows_a_genuine_level_shift_gradually() -> None:
    rng = random.Random(0)
    detector = _detector()
    _spikes(detector, _noisy_loss(rng, 500))

    shifted = [value + 2.0 for value in _noisy_loss(rng, 1000)]
    flagged = [detector.update(value) is not None for value in shifted]

    assert flagged[0]
    assert not any(flagged[100:])


@pytest.mark.parametrize(("level", "log_scale"), [(2.0, False), (1.0, True)])
def test_spike_detector_does_not_flag_a_tiny_wiggle_after_a_constant_series(
    level: float, log_scale: bool
) -> None:
    detector = _detector(log_scale=log_scale)
    _spikes(detector, [level] * 200)

    assert detector.update(level + 1e-9) is None


def test_spike_detector_flags_a_1_percent_jump_after_a_constant_series() -> None:
    detector = _detector()
    _spikes(detector, [2.0] * 200)

    spike = detector.update(2.02)

    # The standard-deviation floor is 0.1% of the mean: 0.02 / 0.002 = 10 sd.
    assert spike is not None
    assert spike.zscore == pytest.approx(10.0)


def test_spike_detector_continues_identically_after_a_state_dict_round_trip() -> None:
    rng = random.Random(0)
    series = _noisy_loss(rng, 600)
    for step in (150, 320, 330, 450):
        series[step] = 20.0
    uninterrupted = _detector()
    expected = [uninterrupted.update(value) for value in series]

    first = _detector()
    head = [first.update(value) for value in series[:300]]
    resumed = _detector()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    tail = [resumed.update(value) for value in series[300:]]

    assert head + tail == expected
    assert resumed.count == uninterrupted.count
    assert sum(verdict is not None for verdict in expected) == 4


def test_spike_detector_mean_and_variance_match_a_hand_computation() -> None:
    detector = SpikeDetector(threshold=10.0, warmup=2, alpha=0.5)

    for value in (1.0, 3.0):
        detector.update(value)
    # Warm-up: plain mean 2, population variance 1.
    assert detector.state_dict() == {"count": 2, "mean": pytest.approx(2.0), "var": 1.0}

    detector.update(5.0)
    # EMA: diff 3, incr 1.5, mean 3.5, var 0.5 * (1 + 3 * 1.5) = 2.75.
    assert detector.state_dict() == {"count": 3, "mean": 3.5, "var": pytest.approx(2.75)}

    detector.update(4.0)
    # diff 0.5, incr 0.25, mean 3.75, var 0.5 * (2.75 + 0.125) = 1.4375.
    assert detector.state_dict() == {"count": 4, "mean": 3.75, "var": pytest.approx(1.4375)}


def test_spike_detector_feeds_a_spike_to_its_statistics_clamped() -> None:
    detector = SpikeDetector(threshold=2.0, warmup=2, alpha=0.5)
    for value in (1.0, 3.0):
        detector.update(value)

    spike = detector.update(10.0)

    # Mean 2, sd 1: z = 8, and 10 enters the statistics as 2 + 2 * 1 = 4.
    assert spike is not None
    assert spike.value == 10.0
    assert spike.zscore == pytest.approx(8.0)
    assert spike.mean == pytest.approx(2.0)
    assert detector.state_dict() == {"count": 3, "mean": 3.0, "var": pytest.approx(1.5)}


def test_spike_detector_in_log_scale_reports_the_mean_in_the_original_space() -> None:
    detector = SpikeDetector(threshold=2.0, warmup=2, alpha=0.5, log_scale=True)
    for value in (1.0, math.exp(2.0)):
        detector.update(value)

    spike = detector.update(math.exp(10.0))

    # Log mean 1, log sd 1: z = 9, mean reported as e ** 1.
    assert spike is not None
    assert spike.zscore == pytest.approx(9.0)
    assert spike.mean == pytest.approx(math.e)


@pytest.mark.parametrize(
    ("threshold", "warmup", "alpha", "match"),
    [
        (0.0, 100, 0.01, r"threshold must be a z-score > 0 .*got 0\.0"),
        (math.nan, 100, 0.01, r"threshold must be a z-score > 0 .*got nan"),
        (6.0, 0, 0.01, r"warmup must be a number of values >= 1 .*got 0"),
        (6.0, 100, 0.0, r"alpha must be an EMA weight in \(0, 1\) .*got 0\.0"),
        (6.0, 100, 1.0, r"alpha must be an EMA weight in \(0, 1\) .*got 1\.0"),
    ],
)
def test_spike_detector_rejects_bad_constructor_arguments(
    threshold: float, warmup: int, alpha: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        SpikeDetector(threshold=threshold, warmup=warmup, alpha=alpha)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"count": 3, "mean": 2.0}, r"exactly the keys \['count', 'mean', 'var'\]"),
        ({"count": 3, "mean": 2.0, "var": 1.0, "std": 1.0}, r"exactly the keys"),
        ({"count": -1, "mean": 2.0, "var": 1.0}, r"'count' must be an integer >= 0, got -1"),
        ({"count": 2.5, "mean": 2.0, "var": 1.0}, r"'count' must be an integer >= 0, got 2\.5"),
        ({"count": 3, "mean": math.nan, "var": 1.0}, r"'mean' must be a finite number, got nan"),
        ({"count": 3, "mean": "2", "var": 1.0}, r"'mean' must be a finite number, got '2'"),
        ({"count": 3, "mean": 2.0, "var": -1.0}, r"'var' must be a finite number >= 0, got -1\.0"),
    ],
)
def test_spike_detector_rejects_a_malformed_state_and_keeps_its_own(
    state: dict[str, Any], match: str
) -> None:
    detector = _detector()
    _spikes(detector, [1.0, 2.0, 3.0])
    before = detector.state_dict()

    with pytest.raises(ValueError, match=match):
        detector.load_state_dict(state)

    assert detector.state_dict() == before


def test_spike_detector_numbers_consecutive_spikes_as_one_episode() -> None:
    detector = SpikeDetector(threshold=6.0, warmup=20, alpha=0.02)
    for step in range(40):
        detector.update(1.0 + 0.01 * (step % 3))
    runs = [detector.update(50.0) for _ in range(3)]
    assert [spike.run_length for spike in runs if spike is not None] == [1, 2, 3]
    assert detector.update(1.0) is None
    again = detector.update(50.0)
    assert again is not None and again.run_length == 1
