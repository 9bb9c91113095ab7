"""Device timing with stand-in events (torch.cuda.Event's interface) on CPU, and on CUDA."""

from __future__ import annotations

import pytest
import torch

from stabmon.pipeline.readings import Readings
from stabmon.probes.device_timing import DeviceTimer


class FakeDevice:
    """A device clock: events complete when ``run_until`` passes them."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.done_up_to = -1.0

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self._device = device
        self.at_ms = -1.0

    def record(self, stream: object = None) -> None:
        self.at_ms = self._device.now_ms

    def query(self) -> bool:
        return self.at_ms <= self._device.done_up_to

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an unfinished event would block"
        return end.at_ms - self.at_ms


def _readings() -> Readings:
    return Readings(labels={"rank": "0", "run": "r"})


def test_device_timer_attributes_intervals_to_the_phase_they_start() -> None:
    device = FakeDevice()
    readings = _readings()
    timer = DeviceTimer(readings, new_event=device.event)
    for phase, at_ms, step_end in [("forward", 0, False), ("backward", 10, False),
                                   ("optimizer", 40, False), ("data_wait", 45, True),
                                   ("forward", 65, False)]:  # fmt: skip
        device.now_ms = at_ms
        timer.mark(phase, step_end)
    device.done_up_to = 100
    timer.poll()
    assert readings.device_phase_seconds == pytest.approx(
        {"forward": 0.010, "backward": 0.030, "optimizer": 0.005, "data_wait": 0.020}
    )


def test_device_timer_never_reads_an_unfinished_event() -> None:
    device = FakeDevice()
    readings = _readings()
    timer = DeviceTimer(readings, new_event=device.event)
    for at_ms, phase in [(0, "forward"), (10, "backward"), (30, "optimizer")]:
        device.now_ms = at_ms
        timer.mark(phase)
    device.done_up_to = 15  # the device has passed the second event only
    timer.poll()
    assert readings.device_phase_seconds == pytest.approx({"forward": 0.010})


def test_device_timer_measures_step_to_step_duration() -> None:
    device = FakeDevice()
    readings = _readings()
    timer = DeviceTimer(readings, new_event=device.event)
    for step in range(4):
        device.now_ms = 100.0 * step
        timer.mark("forward")
        device.now_ms = 100.0 * step + 60
        timer.mark("data_wait", step_end=True)
    device.done_up_to = 10_000
    timer.poll()
    assert readings.device_step_duration.count == 3
    assert readings.device_step_duration.snapshot()[1] == pytest.approx(0.3)


def test_device_timer_memory_stays_bounded_when_the_device_never_catches_up() -> None:
    device = FakeDevice()
    timer = DeviceTimer(_readings(), new_event=device.event, max_pending=8)
    for _ in range(1000):
        timer.mark("forward")
        timer.poll()
    assert timer.dropped == 1000 - 8


@pytest.mark.gpu
def test_device_timer_on_cuda_measures_real_kernels() -> None:
    readings = _readings()
    timer = DeviceTimer(readings)
    x = torch.randn(2048, 2048, device="cuda")
    timer.mark("forward")
    for _ in range(20):
        x = x @ x / 2048
    timer.mark("data_wait", step_end=True)
    torch.cuda.synchronize()
    timer.poll()
    assert readings.device_phase_seconds["forward"] > 0
