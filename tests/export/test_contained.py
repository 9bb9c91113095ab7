"""stabmon.export.contained: a failing collector costs a scrape its own families only."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from stabmon.export.contained import ContainedCollector
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter


class _Fixed(Collector):
    def __init__(self, name: str) -> None:
        self._name = name

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self._name, "A fixed reading.", value=1.0)


class _FailsAfterOne(Collector):
    """Yields one family, then raises: a collector that breaks part-way through."""

    def __init__(self) -> None:
        self.calls = 0

    def collect(self) -> Iterator[Metric]:
        self.calls += 1
        yield GaugeMetricFamily("test_half_done", "Yielded before the failure.", value=1.0)
        raise RuntimeError("the reading went away")


def _scraped_names(registry: CollectorRegistry) -> set[str]:
    text = generate_latest(registry).decode()
    return {family.name for family in text_string_to_metric_families(text)}


def test_a_failing_collector_leaves_the_collectors_after_it_in_the_scrape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guard = Guard(LogLimiter())
    registry = CollectorRegistry()
    failing = _FailsAfterOne()
    registry.register(_Fixed("test_before"))
    registry.register(ContainedCollector(failing, guard=guard, component="probe"))
    registry.register(_Fixed("test_after"))

    with caplog.at_level(logging.WARNING, logger="stabmon"):
        first = _scraped_names(registry)
        second = _scraped_names(registry)

    # All or nothing: the family yielded before the failure is left out too.
    assert first == second == {"test_before", "test_after"}
    assert failing.calls == 2
    assert guard.counts == {"probe": 2}
    logged = [
        record for record in caplog.records if "contained an error in probe" in record.message
    ]
    assert len(logged) == 1  # logged once, counted every time
    assert "RuntimeError: the reading went away" in logged[0].message


def test_a_healthy_collector_passes_through_unchanged() -> None:
    guard = Guard(LogLimiter(), components=("probe",))
    registry = CollectorRegistry()
    registry.register(ContainedCollector(_Fixed("test_reading"), guard=guard, component="probe"))

    assert _scraped_names(registry) == {"test_reading"}
    assert guard.counts == {"probe": 0}
