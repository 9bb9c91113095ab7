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


def _sampled_loop(
    timer: DeviceTimer, device: FakeDevice, steps: int, step_ms: float, first: int = 0
) -> None:
    """``steps`` steps (from step ``first``) of 10 ms data wait, 20 forward, 30 backward,
    ``step_ms - 60`` optimizer; the device keeps up, and each step end polls, as the hooks do."""
    for step in range(first, first + steps):
        start = step * step_ms
        for phase, at_ms in [("forward", 10), ("backward", 30), ("optimizer", 60)]:
            device.now_ms = start + at_ms
            timer.mark(phase)
        device.now_ms = start + step_ms
        timer.mark("data_wait", step_end=True)
        device.done_up_to = device.now_ms
        timer.poll()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_fast_steps_are_timed_one_in_every_and_weighted_to_stand_for_all() -> None:
    device, readings, clock = FakeDevice(), _readings(), _Clock()
    recorded = []
    timer = DeviceTimer(readings, new_event=device.event, every=4, clock=clock,
                        record=lambda event: recorded.append(event.record()))  # fmt: skip
    _sampled_loop(timer, device, 400, step_ms=100)  # the host clock stands still: fast steps

    # About one step in four is timed, in windows of five events (four when two are adjacent).
    assert 400 * 0.9 <= len(recorded) <= 400 * 1.6
    # Each timed step stands for itself and the untimed steps before it: the steps up to the
    # last timed one are all counted, each once.
    covered = readings.device_phase_seconds["forward"] / 0.020
    assert covered == pytest.approx(round(covered)) and 400 - 7 <= round(covered) <= 400
    assert readings.device_phase_seconds["backward"] == pytest.approx(0.030 * covered)
    assert readings.device_phase_seconds["optimizer"] == pytest.approx(0.040 * covered)
    assert readings.device_phase_seconds["data_wait"] == pytest.approx(0.010 * (covered - 1))
    # The timed steps' own durations, never a span of untimed steps.
    count = readings.device_step_duration.count
    assert 60 <= count <= 140
    assert readings.device_step_duration.snapshot()[1] == pytest.approx(0.1 * count)


def test_a_stutter_every_fourth_batch_is_not_missed_between_windows() -> None:
    """Windows at a fixed stride would keep missing (or always hit) a periodic stutter; the
    drawn gaps estimate its idle time."""
    device, readings, clock = FakeDevice(), _readings(), _Clock()
    timer = DeviceTimer(readings, new_event=device.event, every=8, clock=clock)
    at_ms, idle_ms = 0.0, 0.0
    for step in range(2000):
        wait = 210.0 if step % 4 == 1 else 10.0
        idle_ms += wait if step else 0.0
        for phase, offset in [("forward", wait), ("backward", 20), ("optimizer", 30)]:
            at_ms += offset
            device.now_ms = at_ms
            timer.mark(phase)
        at_ms += 40
        device.now_ms = at_ms
        timer.mark("data_wait", step_end=True)
        device.done_up_to = at_ms
        timer.poll()
        clock.now += 0.001

    assert readings.device_phase_seconds["data_wait"] == pytest.approx(idle_ms / 1000, rel=0.2)


def test_long_steps_are_all_timed() -> None:
    device, readings, clock = FakeDevice(), _readings(), _Clock()
    timer = DeviceTimer(readings, new_event=device.event, every=4, clock=clock)
    for step in range(12):
        _sampled_loop(timer, device, 1, step_ms=100, first=step)
        clock.now += 0.1  # 100 ms a step on the host: timing each costs nothing that shows

    # Step 0 is timed, then a gap (nothing said yet that steps are long); the step after it
    # stands for the gap, and its window's steps were long: from then on each step is timed,
    # once. Every step is counted once.
    assert readings.device_phase_seconds["forward"] == pytest.approx(0.020 * 12)
    assert readings.device_step_duration.count >= 12 - 7


def test_a_named_phase_between_windows_is_timed_once() -> None:
    device, readings, clock = FakeDevice(), _readings(), _Clock()
    timer = DeviceTimer(readings, new_event=device.event, every=4, clock=clock)
    _sampled_loop(timer, device, 2, step_ms=100)  # step 0 timed, step 1 not
    device.now_ms = 1000
    timer.mark("eval")
    device.now_ms = 1500
    timer.mark("data_wait")  # the evaluation ends between windows
    device.now_ms = 1600
    timer.mark("forward")  # not timed: no window
    device.done_up_to = 10**9
    timer.poll()

    assert readings.device_phase_seconds["eval"] == pytest.approx(0.5)
    assert readings.device_phase_seconds["forward"] == pytest.approx(0.020)
    assert "data_wait" not in readings.device_phase_seconds


def test_while_idle_a_mark_of_the_loops_own_phases_changes_nothing() -> None:
    """The loop timer skips the forward, backward and optimizer marks while the device timer
    is ``idle`` (issue 38): in a loop of fast steps with named phases between windows, each
    such mark made while idle records no event and leaves the timer's state as it was."""
    device, readings, clock = FakeDevice(), _readings(), _Clock()
    recorded: list[object] = []
    timer = DeviceTimer(readings, new_event=device.event, every=4, clock=clock,
                        record=lambda event: recorded.append(event))  # fmt: skip
    idle_marks = 0
    for step in range(200):
        for phase in ("forward", "backward", "optimizer"):
            if timer.idle:
                before = (len(recorded), vars(timer).copy())
                timer.mark(phase)
                assert (len(recorded), vars(timer)) == before
                idle_marks += 1
            else:
                timer.mark(phase)
        timer.mark("data_wait", step_end=True)
        if step % 37 == 0:  # a named phase between the steps, in a window or not
            timer.mark("eval")
            timer.mark("data_wait")
    assert idle_marks > 200  # most fast steps fall between windows


def test_the_event_pool_covers_a_long_run_of_windows() -> None:
    """Each window's step end is kept for the next timed step's duration; once replaced it goes
    back to the pool: a long run allocates no event a window (issue 38)."""
    device, readings, clock = FakeDevice(), _readings(), _Clock()
    created: list[FakeEvent] = []

    def new_event() -> FakeEvent:
        created.append(device.event())
        return created[-1]

    timer = DeviceTimer(readings, new_event=new_event, every=8, clock=clock)
    _sampled_loop(timer, device, 100, step_ms=100)
    early = len(created)
    _sampled_loop(timer, device, 2000, step_ms=100, first=100)
    assert len(created) == early  # the pool held enough for every later window
    assert readings.device_step_duration.count > 100  # and the timed steps were measured
