"""The trend leak rule on synthetic memory series: noise, warm-up, leaks, bounded state."""

from __future__ import annotations

import random

import pytest

from stabmon.detectors.trend import MemoryTrend, mann_kendall_z, theil_sen_slope

MIB = 2**20


def _first_suspected(trend: MemoryTrend, series: list[float]) -> int | None:
    for index, value in enumerate(series):
        verdict = trend.update(value)
        if verdict is not None and verdict.newly_suspected:
            return index
    return None


def _rss_noise(rng: random.Random, level: float, count: int) -> list[float]:
    """RSS-like noise: +-10% upward excursions (transient allocations), small jitter."""
    return [level * (1 + rng.uniform(0, 0.10) + rng.gauss(0, 0.002)) for _ in range(count)]


def test_theil_sen_and_mann_kendall_match_hand_computed_values() -> None:
    assert theil_sen_slope([1.0, 2.0, 3.0, 4.0, 100.0]) == 1.0  # the outlier does not pull it
    assert theil_sen_slope([5.0, 5.0, 5.0]) == 0.0
    # S = 3 for an increasing series of 3: z = (3 - 1) / sqrt(3 * 2 * 11 / 18)
    assert mann_kendall_z([1.0, 2.0, 3.0]) == pytest.approx(2 / (66 / 18) ** 0.5)
    assert mann_kendall_z([3.0, 2.0, 1.0]) == pytest.approx(-2 / (66 / 18) ** 0.5)


def test_trend_rule_stays_quiet_on_rss_noise_of_ten_percent_for_a_million_steps() -> None:
    rng = random.Random(0)
    trend = MemoryTrend(bucket=10, window=24, min_floors=12)
    # 1M steps sampled every 10 steps: 100,000 samples of a flat but noisy RSS.
    assert _first_suspected(trend, _rss_noise(rng, 800 * MIB, 100_000)) is None


def test_trend_rule_stays_quiet_during_warmup_growth_that_flattens() -> None:
    rng = random.Random(1)
    # +50% over the first 50 samples (500 steps: caches, allocator pools), flat after.
    warmup = [400 * MIB * (1 + 0.5 * min(i, 50) / 50) for i in range(600)]
    series = [v * (1 + rng.uniform(0, 0.05)) for v in warmup] + _rss_noise(rng, 600 * MIB, 5000)
    assert _first_suspected(MemoryTrend(bucket=10, window=24, min_floors=12), series) is None


def test_trend_rule_finds_a_slow_leak_hidden_in_rss_noise() -> None:
    rng = random.Random(2)
    # A leak of 0.01% of the level per sample (1% per 100 samples) under +-10% noise.
    series = [800 * MIB * (1 + 1e-4 * i) * (1 + rng.uniform(0, 0.10)) for i in range(20_000)]
    found = _first_suspected(MemoryTrend(bucket=10, window=24, min_floors=12), series)
    assert found is not None and found < 2400


def test_trend_rule_finds_a_per_step_leak_within_two_thousand_steps() -> None:
    # total_loss += loss keeps each step's graph: a few KiB a step on 200 MiB, sampled every
    # 10 steps, with allocator noise.
    rng = random.Random(3)
    series = [200 * MIB + 20 * 1024 * step + rng.uniform(0, 4 * MIB) for step in range(0, 2000, 10)]
    found = _first_suspected(MemoryTrend(bucket=10, window=24, min_floors=12), series)
    assert found is not None and found * 10 < 2000


def test_trend_rule_reports_a_leak_once_while_it_lasts() -> None:
    trend = MemoryTrend(bucket=2, window=16, min_floors=8)
    newly = [v.newly_suspected for i in range(400) if (v := trend.update(1e6 + 1e4 * i))]
    assert newly.count(True) == 1


def test_trend_state_is_bounded_by_the_window() -> None:
    trend = MemoryTrend(bucket=1, window=16, min_floors=8)
    for i in range(10_000):
        trend.update(float(i % 7))
    assert len(trend._floors) == 16  # the only growing structure: a bounded deque


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"bucket": 0}, "bucket >= 1"), ({"z_threshold": 0}, "z_threshold > 0")],
)
def test_trend_rejects_bad_settings_with_an_example(
    settings: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryTrend(**settings)  # type: ignore[arg-type]


def test_trend_rule_reports_a_staircase_leak_once() -> None:
    # 32 MiB kept once every 100 samples (an epoch's worth of objects), then freed.
    series = [500 * MIB + 32 * MIB * min(i // 100, 12) for i in range(2000)]
    series += [500 * MIB] * 1500
    trend = MemoryTrend(bucket=10, window=24, min_floors=12)
    verdicts = [v for value in series if (v := trend.update(value)) is not None]
    assert [v.newly_suspected for v in verdicts].count(True) == 1
    assert not verdicts[-1].suspected  # the leak was freed: the suspicion has ended
