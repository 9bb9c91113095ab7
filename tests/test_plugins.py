"""The extension point: a probe plugged in by one line of stabmon.plugins.PLUGINS.

Each test adds its probe the way a maintainer would, to the one list the Monitor builds its
plug-ins from, and reads the result through the public paths (a real scrape, the event log).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import cast

import pytest
import torch
from conftest import MonitorFactory
from helpers import events, scrape, tiny_model, train_step, value

import stabmon.plugins
from stabmon.contract import MetricDef
from stabmon.extension import Attachment, Reading
from stabmon.guard import Guard
from stabmon.log import LOGGER, LogLimiter
from stabmon.monitor import Monitor
from stabmon.plugins import PLUGINS, Plugged
from stabmon.probes.grads import GradSummary

# The "Adding a probe" example of docs/architecture.md, verbatim (its contract row here).
LEARNING_RATE = MetricDef(
    "stabmon_learning_rate",
    "gauge",
    "Learning rate of each optimizer parameter group, read at scrape time.",
    ("group",),
)


class LearningRate:
    """Plug-in: the optimizer's learning rate per parameter group, read at scrape."""

    component = "exporter"

    def __init__(self, attachment: Attachment) -> None:
        self._optimizer = attachment.optimizer

    def readings(self) -> Iterable[Reading]:
        groups = self._optimizer.param_groups
        yield LEARNING_RATE, [((str(i),), float(g["lr"])) for i, g in enumerate(groups)]


class Recording:
    """Plug-in with every hook: what the Monitor called, in order."""

    component = "detectors"
    calls: list[tuple[str, int | None]]

    def __init__(self, attachment: Attachment) -> None:
        self.calls = []
        self.next_step = 2  # step_end at the second step, then every third
        Recording.last = self

    def step_end(self, steps: int) -> None:
        self.calls.append(("step_end", steps))
        self.next_step = steps + 3

    def epoch_end(self, step: int | None) -> None:
        self.calls.append(("epoch_end", step))

    def grads_judged(self, step: int, summary: GradSummary) -> None:
        self.calls.append(("grads_judged", step))

    def detach(self) -> None:
        self.calls.append(("detach", -1))


class Broken:
    """Plug-in whose every hook raises: training goes on, the failure is counted."""

    component = "detectors"
    next_step = 1

    def __init__(self, attachment: Attachment) -> None:
        pass

    def step_end(self, steps: int) -> None:
        raise RuntimeError("a probe bug")

    def readings(self) -> Iterable[Reading]:
        raise RuntimeError("a collector bug")


def _plug(monkeypatch: pytest.MonkeyPatch, *plugins: object) -> None:
    # The one registration line, as a test makes it: PLUGINS plus the new class.
    monkeypatch.setattr(stabmon.plugins, "PLUGINS", (*PLUGINS, *plugins))


def test_a_probe_plugged_into_plugins_publishes_its_metric_on_a_real_scrape(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plug(monkeypatch, LearningRate)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    monitor = attach(model, optimizer)
    train_step(model, optimizer, monitor)
    optimizer.param_groups[0]["lr"] = 0.125  # a scheduler's step: read at the next scrape
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_learning_rate", group="0", rank="0") == 0.125


def _attach_plugged(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch, plugin: type
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Monitor]:
    """A tiny model and optimizer attached with ``plugin`` plugged in, judging at once."""
    _plug(monkeypatch, plugin)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    return model, optimizer, attach(model, optimizer, judge_seconds=0)


def test_a_plugged_probe_gets_each_hook_it_implements_at_the_steps_it_asks_for(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, monitor = _attach_plugged(attach, monkeypatch, Recording)
    for _ in range(6):
        train_step(model, optimizer, monitor)
    monitor.epoch_end()
    monitor.detach()
    calls = Recording.last.calls
    assert [c for c in calls if c[0] == "step_end"] == [("step_end", 2), ("step_end", 5)]
    assert [c for c in calls if c[0] == "grads_judged"] == [("grads_judged", s) for s in range(6)]
    assert ("epoch_end", 5) in calls and calls[-1] == ("detach", -1)  # 6 steps: last is 5


def test_a_plugged_epoch_end_gets_the_step_its_epoch_record_names_across_a_resume(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """epoch_end(step) is the index of the epoch's last step (docs/steps.md), as the event
    log's ``epoch`` record; None for an epoch ended before any step."""
    model, optimizer, monitor = _attach_plugged(attach, monkeypatch, Recording)
    monitor.epoch_end()  # before the first step
    monitor.load_state_dict({**monitor.state_dict(), "step": 10})  # resumed after 10 steps
    for _ in range(4):
        train_step(model, optimizer, monitor)
    monitor.epoch_end()
    monitor.detach()
    received = [step for hook, step in Recording.last.calls if hook == "epoch_end"]
    records = [r["step"] for r in events(monitor.event_log_path) if r["event"] == "epoch"]
    assert received == records == [None, 13]  # steps 10..13 ran in this process


def test_a_failing_plugged_probe_is_contained_and_counted_against_its_component(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, monitor = _attach_plugged(attach, monkeypatch, Broken)
    for _ in range(3):
        train_step(model, optimizer, monitor)
    scrape(monitor.metrics_url)  # its readings() fails here, after the errors were read
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_steps_total") == 3  # the rest of the scrape is intact
    # Three step ends and the first scrape (counted once the count itself was collected).
    assert value(samples, "stabmon_internal_errors_total", component="detectors") == 4


class Publishing:
    component = "exporter"

    def readings(self) -> Iterable[Reading]:
        return []


def test_plugged_gives_the_step_end_no_work_without_a_step_end_plug_in() -> None:
    plugged = Plugged(Guard(LogLimiter(LOGGER), ("detectors", "exporter", "hooks")))
    attachment = cast(Attachment, None)  # these factories read nothing from it
    plugged.plug(attachment, factories=(lambda _: Publishing(), lambda _: None))
    # The Monitor's one comparison a step (steps >= next_step) never holds.
    assert plugged.next_step == sys.maxsize
    assert [type(p) for p in plugged.publishing] == [Publishing]
    plugged.plug(attachment, factories=(lambda _: Publishing(), Recording))
    assert plugged.next_step == 2
