"""stabmon.pipeline.readings: the plain numbers a training process exports, read as a scrape
reads them."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from stabmon.contract import ANOMALY_KINDS, PHASES
from stabmon.pipeline.readings import DEFAULT_SECONDS_BUCKETS, Histogram, Readings


class Grads(NamedTuple):
    """A small real implementation of the GradReading protocol (sums given, not computed)."""

    total_norm: float
    zero_grad_params: int
    group_norms: dict[str, float]
    placement_squares: tuple[float, float]


def test_histogram_snapshot_is_cumulative_and_ends_in_inf() -> None:
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 2.0, 3.0):
        histogram.observe(value)
    buckets, total = histogram.snapshot()
    assert buckets == [("0.1", 2.0), ("1.0", 3.0), ("+Inf", 5.0)]
    assert total == pytest.approx(5.65)


def test_histogram_counts_a_value_on_a_bound_in_that_bucket() -> None:
    histogram = Histogram((1.0, 2.0))
    histogram.observe(1.0)
    assert histogram.snapshot()[0][0] == ("1.0", 1.0)


def test_histogram_count_and_totals_grow_with_each_observation() -> None:
    histogram = Histogram()
    assert histogram.totals() == (0.0, 0.0)
    histogram.observe(0.2)
    histogram.observe(700.0)  # past the last bound: only +Inf
    assert histogram.count == 2
    count, total = histogram.totals()
    assert count == 2.0
    assert total == pytest.approx(700.2)
    assert histogram.snapshot()[0][-2] == (repr(DEFAULT_SECONDS_BUCKETS[-1]), 1.0)


def test_readings_start_with_every_anomaly_kind_and_phase_at_zero() -> None:
    readings = Readings(labels={"rank": "0"})
    assert readings.anomalies == dict.fromkeys(ANOMALY_KINDS, 0)
    assert readings.phase_seconds == dict.fromkeys(PHASES, 0.0)
    assert readings.slowdown_active == dict.fromkeys(PHASES, 0)


def test_readings_gradient_figures_are_unset_before_the_first_measurement() -> None:
    readings = Readings(labels={})
    assert (readings.grad_norm, readings.zero_grad_params) == (None, None)
    assert (readings.module_grad_norms, readings.grad_norm_squared) == ({}, {})


def test_readings_gradient_figures_come_from_the_last_measurement() -> None:
    readings = Readings(labels={})
    readings.grads = Grads(5.0, 2, {"encoder": 3.0, "head": 4.0}, (9.0, 16.0))
    assert (readings.grad_norm, readings.zero_grad_params) == (5.0, 2)
    assert readings.module_grad_norms == {"encoder": 3.0, "head": 4.0}
    assert readings.grad_norm_squared == {"replicated": 9.0, "sharded": 16.0}


def test_readings_add_phase_time_accumulates_including_a_new_phase() -> None:
    readings = Readings(labels={})
    readings.add_phase_time(PHASES[0], 1.5)
    readings.add_phase_time(PHASES[0], 0.5)
    readings.add_phase_time("custom", 2.0)
    readings.add_device_phase_time("forward", 0.25)
    readings.add_device_phase_time("forward", 0.25)
    assert readings.phase_seconds[PHASES[0]] == 2.0
    assert readings.phase_seconds["custom"] == 2.0
    assert readings.device_phase_seconds == {"forward": 0.5}


def test_readings_count_anomaly_counts_per_kind() -> None:
    readings = Readings(labels={})
    kind = ANOMALY_KINDS[0]
    readings.count_anomaly(kind)
    readings.count_anomaly(kind)
    assert readings.anomalies[kind] == 2
    assert sum(readings.anomalies.values()) == 2


def test_readings_defaults_are_not_shared_between_instances() -> None:
    first, second = Readings(labels={}), Readings(labels={})
    first.count_anomaly(ANOMALY_KINDS[0])
    first.step_duration.observe(1.0)
    assert second.anomalies[ANOMALY_KINDS[0]] == 0
    assert second.step_duration.count == 0
