"""The extension point: a probe plugged in by one line of stabmon.wiring.plugins.PLUGINS, or by a
user through ``attach(plugins=[...])``.

Each test adds its probe the way a maintainer (the one list the Monitor builds its plug-ins
from) or a user (``attach``) would, and reads the result through the public paths (a real
scrape, the event log, ``Monitor.state_dict()``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from types import SimpleNamespace
from typing import cast

import pytest
import torch
from conftest import MonitorFactory
from helpers import events, scrape, tiny_model, train_step, value

import stabmon.wiring.plugins
from stabmon.contract import MetricDef
from stabmon.errors import StabmonError
from stabmon.extension import Context, Reading
from stabmon.monitor import Monitor
from stabmon.probes.grads import GradSummary
from stabmon.shared.guard import Guard
from stabmon.shared.log import LOGGER, LogLimiter
from stabmon.wiring.plugins import PLUGINS, Plugged

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

    def __init__(self, context: Context) -> None:
        self._optimizer = context.optimizer

    def readings(self) -> Iterable[Reading]:
        groups = self._optimizer.param_groups
        yield LEARNING_RATE, [((str(i),), float(g["lr"])) for i, g in enumerate(groups)]


class Recording:
    """Plug-in with every hook: what the Monitor called, in order."""

    component = "detectors"
    calls: list[tuple[str, int | None]]

    def __init__(self, context: Context) -> None:
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

    def __init__(self, context: Context) -> None:
        pass

    def step_end(self, steps: int) -> None:
        raise RuntimeError("a probe bug")

    def readings(self) -> Iterable[Reading]:
        raise RuntimeError("a collector bug")


def _plug(monkeypatch: pytest.MonkeyPatch, *plugins: object) -> None:
    # The one registration line, as a test makes it: PLUGINS plus the new class.
    monkeypatch.setattr(stabmon.wiring.plugins, "PLUGINS", (*PLUGINS, *plugins))


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
    context = cast(Context, None)  # these factories read nothing from it
    plugged.plug(context, factories=(lambda _: Publishing(), lambda _: None))
    # The Monitor's one comparison a step (steps >= next_step) never holds.
    assert plugged.next_step == sys.maxsize
    assert [type(p) for p in plugged.publishing] == [Publishing]
    plugged.plug(context, factories=(lambda _: Publishing(), Recording))
    assert plugged.next_step == 2


# --- user plug-ins: attach(plugins=[...]) ------------------------------------------------------

#: The device-side example of docs/architecture.md ("Adding a probe"), its contract row here.
PARAMETER_NORM = MetricDef(
    "stabmon_parameter_norm",
    "gauge",
    "Global L2 norm of the trainable parameters after the last optimizer step.",
)


class ParameterNorm:
    """Plug-in: the parameters' global norm after each step, computed on the device and read
    back with the Monitor's other results (never a sync)."""

    component = "grads"
    measure_at = "after_step"

    def __init__(self, context: Context) -> None:
        self._params = [p for p in context.model.parameters() if p.requires_grad]
        self._norm: float | None = None

    def measure(self, step: int) -> torch.Tensor:
        norms = torch._foreach_norm([p.detach() for p in self._params])
        return torch.linalg.vector_norm(torch.stack(norms)).reshape(1)

    def judge(self, step: int, values: list[float]) -> None:
        self._norm = values[0]

    def readings(self) -> Iterable[Reading]:
        if self._norm is not None:
            yield PARAMETER_NORM, [((), self._norm)]


def test_a_device_side_plug_in_passed_to_attach_publishes_what_it_measured_after_the_step(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    monitor = attach(model, optimizer, judge_seconds=0, plugins=[ParameterNorm])
    for _ in range(3):
        train_step(model, optimizer, monitor)
    monitor.state_dict()  # judges what waits (a step's results are read a step later)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    expected = float(torch.linalg.vector_norm(flat))
    published = value(scrape(monitor.metrics_url), "stabmon_parameter_norm", rank="0")
    assert published == pytest.approx(expected, rel=1e-5)


class Losses:
    """Plug-in: every judged training loss, with its step."""

    component = "detectors"
    seen: list[tuple[int, float]] = []

    def __init__(self, context: Context) -> None:
        Losses.seen = []

    def loss_judged(self, step: int, value: float) -> None:
        Losses.seen.append((step, value))


def test_a_loss_plug_in_gets_each_observed_loss_with_the_step_it_belongs_to(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0, plugins=[Losses])
    losses = [float(train_step(model, optimizer, monitor).detach()) for _ in range(4)]
    monitor.detach()
    assert [step for step, _ in Losses.seen] == [0, 1, 2, 3]
    assert [v for _, v in Losses.seen] == pytest.approx(losses)


class Counting:
    """Plug-in with a state: the steps it saw, carried by Monitor.state_dict()."""

    component = "detectors"
    state_key = "counting"
    next_step = 1

    def __init__(self, context: Context) -> None:
        self.count = 0
        Counting.last = self

    def step_end(self, steps: int) -> None:
        self.count += 1
        self.next_step = steps + 1

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not isinstance(state.get("count"), int):
            raise ValueError(f"counting state needs an integer count, got {state!r}")
        self.count = state["count"]


def test_a_stateful_plug_in_resumes_from_the_monitor_state(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    first = attach(model, optimizer, plugins=[Counting])
    for _ in range(3):
        train_step(model, optimizer, first)
    state = first.state_dict()
    first.detach()
    assert state["counting"] == {"count": 3}
    second = attach(model, optimizer, plugins=[Counting])
    second.load_state_dict(state)
    assert Counting.last.count == 3


def test_a_refused_plug_in_state_leaves_the_built_in_state_as_it_was(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, plugins=[Counting])
    before = monitor.state_dict()
    bad = {**before, "loss_spikes": {"count": 7, "mean": 1.0, "var": 0.0}, "counting": {}}
    with pytest.raises(StabmonError, match="malformed: counting state needs an integer count"):
        monitor.load_state_dict(bad)
    assert monitor.state_dict() == before  # the loss statistics loaded first were put back


class SameKey(Counting):
    state_key = "loss_spikes"


def test_attach_refuses_plug_ins_whose_state_keys_clash_and_leaves_the_model_alone(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(StabmonError, match="share the state key\\(s\\) loss_spikes"):
        attach(model, optimizer, plugins=[SameKey])
    assert not model._forward_pre_hooks  # nothing was installed
    attach(model, optimizer)  # and the model can be attached at once


@pytest.mark.parametrize(
    ("plugins", "message"),
    [
        ("LearningRate", "takes a list of plug-in classes"),
        ([LearningRate(cast(Context, SimpleNamespace(optimizer=None)))], "not callable"),
    ],
)
def test_attach_says_what_plugins_takes_when_given_something_else(
    attach: MonitorFactory, plugins: object, message: str
) -> None:
    model = tiny_model()
    with pytest.raises(StabmonError, match=message):
        attach(model, torch.optim.SGD(model.parameters(), lr=0.0), plugins=plugins)


class BrokenMeasure(ParameterNorm):
    def measure(self, step: int) -> torch.Tensor:
        raise RuntimeError("a device probe bug")


def test_a_failing_device_measurement_is_contained_and_counted(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, plugins=[BrokenMeasure])
    for _ in range(3):
        train_step(model, optimizer, monitor)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_steps_total") == 3
    assert value(samples, "stabmon_internal_errors_total", component="grads") == 3


class Sometimes(ParameterNorm):
    """A device plug-in that measures only while ``measuring`` (an armed probe)."""

    measuring = False
    calls: list[int] = []

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        Sometimes.calls = []
        Sometimes.last = self

    def measure(self, step: int) -> torch.Tensor:
        Sometimes.calls.append(step)
        return super().measure(step)

    def loss_judged(self, step: int, value: float) -> None:
        self.measuring = step == 2  # armed by a verdict, for the next step only


def test_a_device_plug_in_that_is_not_measuring_is_not_called_at_all(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0, plugins=[Sometimes])
    for _ in range(6):
        train_step(model, optimizer, monitor)
    assert Sometimes.calls == [3]  # armed by step 2's loss, disarmed by step 3's
