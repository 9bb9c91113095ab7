"""stabmon.wiring.assembly through its own interface: an ``Assembly`` of one Monitor built from a
real tiny CPU model, then its ``serve``, ``start_threads`` and ``announce``, and read
what they made through a real HTTP scrape, the event log in tmp_path and the log. No
Monitor and no hooks; the loop clock is a :class:`~tests.helpers.LoopClock`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stabmon.config import Config, load_config
from stabmon.shared.guard import Guard
from stabmon.shared.log import LOGGER, LogLimiter
from stabmon.wiring.assembly import Assembly
from stabmon.wiring.resources import Resources
from tests.helpers import LoopClock, events, scrape, tiny_model, value, wait_until


class Assembled:
    """The parts of one Monitor built by ``Assembly``; their resources closed after."""

    def __init__(self, tmp_path: Path, **overrides: Any) -> None:
        settings: dict[str, Any] = {"port": 0, "address": "127.0.0.1", "run_dir": str(tmp_path),
                                    "run_id": "r", "scrape_cache_seconds": 0}  # fmt: skip
        settings.update(overrides)
        self.config: Config = load_config({}, overrides=settings, env={})
        self.model = tiny_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.limiter = LogLimiter()
        self.guard = Guard(self.limiter)
        self.resources = Resources()
        # Far from any real clock's reading: a part that read a real clock instead would
        # see a beat a billion seconds off and never (or always) a stall.
        self.clock = LoopClock(start=1e9)
        self.parts = Assembly(
            self.config, self.model, self.optimizer, run_id="r", rank=0, plugins=(),
            guard=self.guard, limiter=self.limiter, resources=self.resources, clock=self.clock,
        )  # fmt: skip

    def serve(self) -> None:
        self.parts.serve(local_rank=0, local_world_size=1)

    def start_threads(self, judge_quiet: Callable[[], None] = lambda: None) -> None:
        self.parts.start_threads(judge_quiet)

    def announce(self) -> None:
        exporter = self.resources.exporter
        self.parts.announce(
            self.model, self.optimizer, metrics_url=exporter.url if exporter else None,
            event_log_path=self.parts.paths.events if self.resources.events else None,
        )  # fmt: skip

    def metric(self, name: str, **labels: str) -> float | None:
        assert self.resources.exporter is not None
        return value(scrape(self.resources.exporter.url), name, **labels)


AssembledFactory = Callable[..., Assembled]


@pytest.fixture
def assembled(tmp_path: Path) -> Iterator[AssembledFactory]:
    made: list[Assembled] = []

    def make(**overrides: Any) -> Assembled:
        made.append(Assembled(tmp_path, **overrides))
        return made[-1]

    yield make
    for one in made:
        one.resources.close()


def _stabmon_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("stabmon-")}


def test_build_starts_no_thread_and_serves_nothing(assembled: AssembledFactory) -> None:
    before = _stabmon_threads()
    one = assembled()
    assert _stabmon_threads() == before
    assert one.resources.exporter is None
    assert one.resources.threads == []


def test_build_measures_every_parameter_of_the_optimizer(assembled: AssembledFactory) -> None:
    one = assembled()
    probe = one.parts.measurements.probe
    assert probe is not None
    assert set(probe.names) == {name for name, _ in one.model.named_parameters()}
    assert one.parts.devices == ()  # a CPU model: no CUDA device to time or sample


def test_build_opens_the_event_log_only_when_it_is_asked_for(assembled: AssembledFactory) -> None:
    assert assembled().resources.events is not None
    assert assembled(event_log=False).resources.events is None


def test_build_watches_placement_unless_device_check_is_off(assembled: AssembledFactory) -> None:
    assert assembled().parts.placement is not None
    assert assembled(device_check="off").parts.placement is None


def test_serve_publishes_the_parts_registry_labelled_with_rank_and_run(
    assembled: AssembledFactory,
) -> None:
    one = assembled()
    one.serve()
    one.parts.readings.steps = 7  # what the loop timer counts at a step's end
    assert one.metric("stabmon_steps_total", rank="0", run="r") == 7
    assert one.metric("stabmon_build_info", rank="0", run="r") == 1


def test_serve_starts_no_exporter_when_serve_metrics_is_off(assembled: AssembledFactory) -> None:
    one = assembled(serve_metrics=False)
    one.serve()
    assert one.resources.exporter is None


def test_start_threads_starts_each_background_thread_and_close_stops_them(
    assembled: AssembledFactory,
) -> None:
    before = _stabmon_threads()
    one = assembled()
    one.start_threads()
    started = _stabmon_threads() - before
    assert {"stabmon-watchdog", "stabmon-stall-action", "stabmon-judge", "stabmon-sampler",
            "stabmon-loader"} <= started  # fmt: skip
    one.resources.close()
    assert _stabmon_threads() - before == set()


def test_start_threads_runs_the_judge_task_it_is_given(assembled: AssembledFactory) -> None:
    one = assembled()
    judged = threading.Event()
    one.start_threads(judge_quiet=judged.set)
    wait_until(judged.is_set, "the judge thread ran its task")


def test_start_threads_watchdog_reports_a_stall_on_the_injected_loop_clock(
    assembled: AssembledFactory,
) -> None:
    one = assembled(stall_seconds=60)
    one.serve()
    one.start_threads()
    one.parts.timer.optimizer_end()  # a step ends: the heartbeat beats at the clock's time
    assert one.metric("stabmon_stalled") == 0
    one.clock.advance(61)  # no step for longer than stall_seconds, on the loop clock only
    wait_until(lambda: one.metric("stabmon_stalled") == 1, "the watchdog saw the stall")


def test_start_threads_publishes_the_hang_metrics(assembled: AssembledFactory) -> None:
    one = assembled()
    one.serve()
    assert one.metric("stabmon_collectives_total") is None
    one.start_threads()
    assert one.metric("stabmon_collectives_total") == 0
    assert one.metric("stabmon_collective_in_progress") == 0


def test_announce_writes_the_attach_record_with_the_parameters_measured(
    assembled: AssembledFactory,
) -> None:
    one = assembled()
    one.serve()
    one.announce()
    (attach,) = [r for r in events(one.parts.paths.events) if r["event"] == "attach"]
    assert attach["parameters"] == len(list(one.model.parameters()))
    exporter = one.resources.exporter
    assert exporter is not None
    assert attach["metrics_url"] == exporter.url
    assert attach["config"]["run_id"] == "r"


def test_announce_logs_where_the_metrics_and_events_are(
    assembled: AssembledFactory, caplog: pytest.LogCaptureFixture
) -> None:
    one = assembled(serve_metrics=False)
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        one.announce()
    expected = (
        f"stabmon: attached (run r, rank 0); metrics at (no exporter); events in "
        f"{one.parts.paths.events}"
    )
    assert expected in caplog.text
