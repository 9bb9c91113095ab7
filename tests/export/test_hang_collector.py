"""stabmon.export.hang_collector: the hang evidence families, read through a real HTTP
scrape of a real Exporter. The readers are plain callables a test changes between
scrapes, as the heartbeat and the stall responder change what they return."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import scrape, value
from prometheus_client import CollectorRegistry

from stabmon import contract as c
from stabmon.export.exporter import Exporter
from stabmon.export.hang_collector import MAX_PHASES, HangCollector
from stabmon.shared.log import LogLimiter

LABELS = {"rank": "1", "run": "job"}


class Evidence:
    """What the training and watchdog threads would report: changed by the test."""

    def __init__(self) -> None:
        self.phase = "startup"
        self.collectives = 0
        self.inside = False
        self.state: str | None = None


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def served(registry: CollectorRegistry) -> Iterator[tuple[Evidence, str]]:
    evidence = Evidence()
    registry.register(
        HangCollector(
            LABELS,
            phase=lambda: evidence.phase,
            collectives=lambda: evidence.collectives,
            in_collective=lambda: evidence.inside,
            hang_state=lambda: evidence.state,
        )
    )
    exporter = Exporter(registry, address="127.0.0.1", ports=[0], limiter=LogLimiter())
    assert exporter.start()
    url = exporter.url
    assert url is not None
    yield evidence, url
    exporter.stop()


def test_exactly_the_current_loop_phase_is_one_and_every_known_phase_is_exported(
    served: tuple[Evidence, str],
) -> None:
    evidence, url = served
    evidence.phase = "backward"
    samples = scrape(url)
    phases = {
        dict(labels)["phase"]: v
        for name, labels in samples
        if name == c.LOOP_PHASE.name
        for v in [samples[(name, labels)]]
    }
    assert set(phases) == set(c.LOOP_PHASES)
    assert [phase for phase, v in phases.items() if v == 1.0] == ["backward"]


def test_a_named_phase_keeps_its_zero_series_after_the_loop_leaves_it(
    served: tuple[Evidence, str],
) -> None:
    evidence, url = served
    evidence.phase = "evaluate"
    assert value(scrape(url), c.LOOP_PHASE.name, phase="evaluate", **LABELS) == 1.0
    evidence.phase = "forward"
    assert value(scrape(url), c.LOOP_PHASE.name, phase="evaluate", **LABELS) == 0.0


def test_named_phases_beyond_the_fence_are_not_remembered(
    served: tuple[Evidence, str], registry: CollectorRegistry
) -> None:
    evidence, url = served
    for index in range(MAX_PHASES + 10):
        evidence.phase = f"custom{index}"
        list(registry.collect())  # what a scrape runs, without the HTTP round trip 50 times
    samples = scrape(url)
    assert sum(1 for name, _ in samples if name == c.LOOP_PHASE.name) == MAX_PHASES


def test_collectives_and_in_progress_follow_the_counter(served: tuple[Evidence, str]) -> None:
    evidence, url = served
    evidence.collectives, evidence.inside = 12, True
    samples = scrape(url)
    assert value(samples, c.COLLECTIVES.name, **LABELS) == 12.0
    assert value(samples, c.COLLECTIVE_IN_PROGRESS.name, **LABELS) == 1.0


def test_hang_state_is_all_zero_until_stalled_then_one_for_the_state(
    served: tuple[Evidence, str],
) -> None:
    evidence, url = served
    before = scrape(url)
    assert [value(before, c.HANG_STATE.name, state=s, **LABELS) for s in c.HANG_STATES] == [
        0.0
    ] * len(c.HANG_STATES)
    evidence.state = "data_wait"
    after = scrape(url)
    assert {s for s in c.HANG_STATES if value(after, c.HANG_STATE.name, state=s, **LABELS)} == {
        "data_wait"
    }
