"""Hang evidence as metric families: the loop phase, collectives issued, the stalled state.

Read at scrape time from the heartbeat, the collective counter and the stall
responder, which the training and watchdog threads write with plain stores.
PromQL compares these series across ranks and nodes (the shipped
``StabmonTrainingStalled`` description), so the verdict needs no collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from stabmon import contract as c
from stabmon.export.collector import _counter, _gauge

__all__ = ["HangCollector"]

#: Phases remembered for the 0-valued series; the monitor bounds named phases already
#: (MAX_NAMED_PHASES, then "other"), this is a second fence.
MAX_PHASES = 40


class HangCollector(Collector):
    """``stabmon_loop_phase``, ``stabmon_collectives_total``, ``stabmon_collective_in_progress``
    and ``stabmon_hang_state`` of one Monitor."""

    def __init__(
        self,
        labels: Mapping[str, str],
        *,
        phase: Callable[[], str],
        collectives: Callable[[], int],
        in_collective: Callable[[], bool],
        hang_state: Callable[[], str | None],
    ) -> None:
        self._labels = dict(labels)
        self._phase = phase
        self._collectives = collectives
        self._in_collective = in_collective
        self._hang_state = hang_state
        self._seen: dict[str, None] = dict.fromkeys(c.LOOP_PHASES)

    def collect(self) -> Iterator[Metric]:
        current = self._phase()
        if current not in self._seen and len(self._seen) < MAX_PHASES:
            self._seen[current] = None
        phases = [((phase,), 1.0 if phase == current else 0.0) for phase in self._seen]
        yield _gauge(c.LOOP_PHASE, self._labels, phases)
        yield _counter(c.COLLECTIVES, self._labels, [((), self._collectives())])
        yield _gauge(
            c.COLLECTIVE_IN_PROGRESS, self._labels, [((), 1.0 if self._in_collective() else 0.0)]
        )
        state = self._hang_state()
        yield _gauge(
            c.HANG_STATE,
            self._labels,
            [((name,), 1.0 if name == state else 0.0) for name in c.HANG_STATES],
        )
