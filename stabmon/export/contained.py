"""A collector that never takes a scrape down: its failure is contained, counted, logged once.

A registry's ``collect`` walks its collectors in one generator, so a collector
that raises ends the walk and every collector after it goes missing. Wrapped,
a failing collector yields nothing for that scrape; the guard counts it in
``stabmon_internal_errors_total{component}`` and logs it once.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from stabmon.shared.guard import Guard

__all__ = ["ContainedCollector"]


class ContainedCollector(Collector):
    """``inner``'s families, or none (counted against ``component``) when it fails."""

    def __init__(self, inner: Collector, *, guard: Guard, component: str) -> None:
        self._inner = inner
        self._guard = guard
        self._component = component

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(self._inner.collect())
        except Exception as error:  # containing everything is the point
            self._guard.record(self._component, error)
            return iter(())
        return iter(families)
