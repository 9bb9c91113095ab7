"""stabmon.pipeline.measurements.Measurements through its own interface: a real tiny CPU model and
optimizer in, what the hooks would hand it (``step``, ``clip``, ``loss``, ``scale``) called
directly, and the result read through a real HTTP scrape of its readings. No Monitor, no
hooks; the loop clock is a number handed to ``poll``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from stabmon.config import Config, load_config
from stabmon.export.collector import ReadingsCollector
from stabmon.export.exporter import Exporter
from stabmon.pipeline.measurements import Measurements, param_signature
from stabmon.pipeline.readings import Readings
from stabmon.pipeline.recorder import Recorder
from stabmon.probes.memory import MemorySampler
from stabmon.shared.guard import Guard
from stabmon.shared.heartbeat import Heartbeat
from stabmon.shared.log import LogLimiter
from stabmon.wiring.context import PluginContext
from stabmon.wiring.plugins import Plugged
from tests.helpers import scrape, tiny_model, value


class Harness:
    """A Measurements on a tiny model, its readings served on port 0."""

    def __init__(self, **overrides: Any) -> None:
        self.config: Config = load_config({}, overrides=overrides, env={})
        self.model = tiny_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        limiter = LogLimiter()
        self.guard = Guard(limiter)
        self.readings = Readings(labels={"rank": "0", "run": "r"})
        recorder = Recorder(self.config, self.readings, events=None, limiter=limiter)
        plugged = Plugged(self.guard)
        self.measurements = Measurements(
            self.model, self.optimizer, self.config, readings=self.readings, recorder=recorder,
            plugged=plugged, guard=self.guard, limiter=limiter,
        )  # fmt: skip
        # The built-in judges (clip coefficient, AMP scale, ...), as the Monitor plugs them.
        plugged.plug(
            PluginContext(
                self.config, self.model, self.optimizer, readings=self.readings,
                memory=MemorySampler(self.readings, None, lambda: ()), heartbeat=Heartbeat(),
                run_directory=Path("/nonexistent"), rank=0, recorder=recorder,
                engine=self.measurements.engine,
            )
        )  # fmt: skip
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ReadingsCollector(self.readings, self.guard.counts))
        self.exporter = Exporter(registry, address="127.0.0.1", ports=[0], limiter=limiter)
        assert self.exporter.start()

    def backward(self) -> None:
        self.optimizer.zero_grad()
        self.model(torch.randn(4, 8)).pow(2).mean().backward()

    def poll(self, now: float) -> None:
        with self.measurements.engine.lock:  # the caller holds it, as the step post-hook does
            self.measurements.poll(now)

    def metric(self, name: str, **labels: str) -> float | None:
        return value(scrape(self.exporter.url), name, **labels)


HarnessFactory = Callable[..., Harness]


@pytest.fixture
def harness() -> Iterator[HarnessFactory]:
    made: list[Harness] = []

    def make(**overrides: Any) -> Harness:
        made.append(Harness(**overrides))
        return made[-1]

    yield make
    for one in made:
        one.exporter.stop()


def _total_norm(model: torch.nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads))


def test_measurements_step_publishes_the_global_grad_norm_once_polled(
    harness: HarnessFactory,
) -> None:
    h = harness()
    h.backward()
    h.measurements.step(h.optimizer)
    h.poll(0.0)
    assert h.metric("stabmon_grad_norm") == pytest.approx(_total_norm(h.model), rel=1e-5)


def test_measurements_poll_judges_waiting_results_only_once_judge_seconds_have_passed(
    harness: HarnessFactory,
) -> None:
    h = harness(judge_seconds=10.0)
    h.backward()
    h.measurements.step(h.optimizer)
    h.poll(100.0)  # the first result is judged at once
    first = _total_norm(h.model)
    h.backward()
    h.measurements.step(h.optimizer)
    h.poll(105.0)  # five seconds on the loop clock: still waiting
    assert h.metric("stabmon_grad_norm") == pytest.approx(first, rel=1e-5)
    h.poll(110.0)
    second = _total_norm(h.model)
    assert second != pytest.approx(first, rel=1e-5)
    assert h.metric("stabmon_grad_norm") == pytest.approx(second, rel=1e-5)


def test_measurements_clip_measures_the_gradients_before_the_clip_scales_them(
    harness: HarnessFactory,
) -> None:
    h = harness()
    h.backward()
    before = _total_norm(h.model)
    max_norm = before / 4
    h.measurements.clip(max_norm)  # what the clip watch calls before torch clips
    torch.nn.utils.clip_grad_norm_(h.model.parameters(), max_norm)
    assert _total_norm(h.model) == pytest.approx(max_norm, rel=1e-4)
    h.measurements.step(h.optimizer)  # the step uses the clip's measurement
    h.poll(0.0)
    assert h.metric("stabmon_grad_norm") == pytest.approx(before, rel=1e-5)
    assert h.metric("stabmon_grad_clip_coefficient") == pytest.approx(0.25, rel=1e-4)
    assert h.metric("stabmon_grad_clipped_steps_total") == 1


def test_measurements_step_measures_anew_when_new_gradients_replaced_the_clips(
    harness: HarnessFactory,
) -> None:
    h = harness()
    h.backward()
    h.measurements.clip(1e-3)
    h.measurements.forget_preclip()  # what the forward pre-hook does: new gradients are coming
    h.backward()
    h.measurements.step(h.optimizer)
    h.poll(0.0)
    assert h.metric("stabmon_grad_norm") == pytest.approx(_total_norm(h.model), rel=1e-5)


def test_measurements_step_measures_a_param_group_added_after_attach(
    harness: HarnessFactory,
) -> None:
    h = harness()
    extra = torch.nn.Parameter(torch.full((3,), 2.0))
    h.optimizer.add_param_group({"params": [extra]})
    h.backward()
    extra.grad = torch.full((3,), 5.0)
    h.measurements.step(h.optimizer)
    h.poll(0.0)
    expected = math.sqrt(_total_norm(h.model) ** 2 + 3 * 25.0)
    assert h.metric("stabmon_grad_norm") == pytest.approx(expected, rel=1e-5)


def test_measurements_loss_of_a_host_tensor_is_published_at_once_when_judge_seconds_is_zero(
    harness: HarnessFactory,
) -> None:
    h = harness(judge_seconds=0)
    h.measurements.loss(torch.tensor(2.5), step=0)
    assert h.metric("stabmon_loss") == 2.5


def test_measurements_loss_of_a_batch_of_losses_is_their_mean(harness: HarnessFactory) -> None:
    h = harness(judge_seconds=0)
    h.measurements.loss(torch.tensor([1.0, 2.0, 6.0]), step=0)
    assert h.metric("stabmon_loss") == pytest.approx(3.0)


def test_measurements_loss_as_a_float_waits_for_the_next_poll_when_judge_seconds_is_set(
    harness: HarnessFactory,
) -> None:
    h = harness(judge_seconds=10.0)
    h.poll(0.0)  # nothing waits: nothing is judged, the clock of the last judgement stands
    h.measurements.loss(4.0, step=0)
    h.measurements.loss(7.0, step=1)
    assert h.metric("stabmon_loss") is None
    h.poll(1.0)
    assert h.metric("stabmon_loss") == 7.0


def test_measurements_loss_rejects_a_complex_tensor_saying_what_to_pass(
    harness: HarnessFactory,
) -> None:
    h = harness()
    with pytest.raises(TypeError, match=r"complex-valued loss; pass a real loss"):
        h.measurements.loss(torch.tensor(1 + 2j), step=0)


def test_measurements_scale_publishes_the_grad_scalers_scale_once_polled(
    harness: HarnessFactory,
) -> None:
    h = harness()
    with h.measurements.engine.lock:
        h.measurements.scale(torch.tensor([1024.0], dtype=torch.float64), step=3)  # as scale_tensor
    h.poll(0.0)
    assert h.metric("stabmon_amp_loss_scale") == 1024.0


def test_measurements_rebuild_leaves_out_a_parameter_frozen_after_attach(
    harness: HarnessFactory,
) -> None:
    h = harness()
    first = next(iter(h.model.children()))  # the first Linear
    for param in first.parameters():
        param.requires_grad_(False)
    h.backward()
    h.measurements.step(h.optimizer)
    h.poll(0.0)
    assert h.metric("stabmon_zero_grad_params") == 2  # the frozen weight and bias: no grad
    h.measurements.rebuild_if_trainable_changed()  # at the epoch's end
    h.backward()
    h.measurements.step(h.optimizer)
    h.poll(1.0)
    assert h.metric("stabmon_zero_grad_params") == 0


def test_measurements_contain_a_failing_measurement_and_count_it(harness: HarnessFactory) -> None:
    h = harness()
    h.backward()
    h.optimizer.param_groups[0]["params"].append("not a tensor")  # a probe cannot be built
    h.measurements.step(h.optimizer)  # never raises into the loop
    assert h.metric("stabmon_internal_errors_total", component="grads") == 1


def test_param_signature_counts_param_groups_and_their_parameters() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert param_signature(optimizer) == (1, len(list(model.parameters())))
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert param_signature(optimizer) == (2, len(list(model.parameters())) + 1)
