"""stabmon.probes.timing on an injected loop clock: the boundaries of a step are driven by
hand, the clock moved between them, and the phase seconds, step durations and input wait
read back from Readings. No Monitor, no model, no wall clock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import LoopClock

from stabmon.pipeline.readings import Readings
from stabmon.probes.timing import LoopTimer, TrackedLoader, timed_iteration
from stabmon.shared.heartbeat import Heartbeat


class Loop:
    """A LoopTimer with its readings, heartbeat and clock, and the device marks it made."""

    def __init__(self) -> None:
        self.clock = LoopClock(start=100.0)
        self.readings = Readings(labels={})
        self.heartbeat = Heartbeat(self.clock)
        self.marks: list[tuple[str, bool]] = []
        self.timer = LoopTimer(
            self.readings,
            self.heartbeat,
            clock=self.clock,
            device_mark=lambda phase, ended: self.marks.append((phase, ended)),
        )

    def step(
        self, wait: float = 1.0, forward: float = 2.0, backward: float = 3.0, optimizer: float = 0.5
    ) -> None:
        self.clock.advance(wait)
        self.timer.forward_start()
        self.clock.advance(forward)
        self.timer.forward_end()
        self.clock.advance(backward)
        self.timer.optimizer_start()
        self.clock.advance(optimizer)
        self.timer.optimizer_end()

    def phases(self) -> dict[str, float]:
        return {k: v for k, v in self.readings.phase_seconds.items() if v}


@pytest.fixture
def loop() -> Loop:
    return Loop()


def test_loop_timer_gives_each_stretch_between_boundaries_to_its_phase(loop: Loop) -> None:
    loop.step()
    loop.step()
    assert loop.phases() == {"data_wait": 2.0, "forward": 4.0, "backward": 6.0, "optimizer": 1.0}
    assert loop.readings.steps == 2
    assert loop.heartbeat.steps == 2


def test_loop_timer_observes_step_duration_from_the_second_step_end(loop: Loop) -> None:
    loop.step()
    assert loop.readings.step_duration.count == 0  # no previous step end to measure from
    loop.step(wait=1.0, forward=1.0, backward=1.0, optimizer=1.0)
    assert loop.readings.step_duration.totals() == (1.0, 4.0)
    assert loop.heartbeat.median_step_seconds() == 4.0
    assert loop.heartbeat.last_beat == loop.clock.now


def test_loop_timer_observes_input_wait_between_steps_but_not_before_the_first(
    loop: Loop,
) -> None:
    loop.step(wait=7.0)
    assert loop.readings.data_wait.count == 0
    loop.step(wait=0.2)
    count, total = loop.readings.data_wait.totals()
    assert count == 1.0
    assert total == pytest.approx(0.2)


def test_a_fetch_between_micro_batches_is_input_wait_not_backward(loop: Loop) -> None:
    loop.clock.advance(1.0)
    loop.timer.forward_start()
    loop.clock.advance(1.0)
    loop.timer.forward_end()
    loop.clock.advance(2.0)  # backward of the first micro-batch ...
    loop.clock.advance(5.0)  # ... then the next micro-batch's fetch, timed by track()
    loop.timer.loader_wait(5.0)
    loop.timer.forward_start()
    assert loop.readings.phase_seconds["backward"] == 2.0
    assert loop.readings.phase_seconds["data_wait"] == 6.0


def test_a_compiled_forward_without_hooks_splits_only_tracked_wait_from_forward(
    loop: Loop,
) -> None:
    loop.timer.track_loader()
    loop.clock.advance(0.5)
    loop.timer.loader_wait(0.5)
    loop.clock.advance(3.5)  # forward and backward, compiled: no boundary between
    loop.timer.optimizer_start()
    assert loop.readings.phase_seconds["data_wait"] == 0.5
    assert loop.readings.phase_seconds["forward"] == 3.5
    assert not loop.timer.forward_seen


def test_a_named_phase_takes_all_the_time_inside_it_and_ignores_boundaries(loop: Loop) -> None:
    loop.step()
    loop.timer.enter_named("eval")
    assert loop.heartbeat.phase == "eval" and loop.heartbeat.named_phase
    loop.clock.advance(10.0)
    loop.timer.forward_start()  # the evaluation's own forwards
    loop.clock.advance(10.0)
    loop.timer.forward_end()
    loop.timer.exit_named()
    assert loop.readings.phase_seconds["eval"] == 20.0
    assert loop.readings.phase_seconds["forward"] == 2.0
    assert loop.timer.phase == "data_wait"
    assert not loop.heartbeat.named_phase
    assert loop.heartbeat.last_beat == loop.clock.now  # silence is measured from its end


def test_nested_named_phases_return_to_the_outer_one(loop: Loop) -> None:
    loop.timer.enter_named("eval")
    loop.clock.advance(1.0)
    loop.timer.enter_named("metrics")
    loop.clock.advance(2.0)
    loop.timer.exit_named()
    assert (loop.timer.phase, loop.heartbeat.phase) == ("eval", "eval")
    loop.clock.advance(4.0)
    loop.timer.exit_named()
    assert loop.readings.phase_seconds["eval"] == 5.0
    assert loop.readings.phase_seconds["metrics"] == 2.0
    assert not loop.timer.in_named_phase


def test_an_unwrapped_evaluation_forward_enters_eval_and_keeps_the_heartbeat_alive(
    loop: Loop,
) -> None:
    loop.step()
    loop.clock.advance(30.0)
    loop.timer.eval_forward()
    assert loop.heartbeat.last_beat == loop.clock.now
    assert loop.timer.phase == "eval"
    loop.clock.advance(30.0)
    loop.timer.eval_forward()
    loop.timer.forward_start()  # training resumes
    assert loop.readings.phase_seconds["eval"] == 30.0
    assert loop.readings.phase_seconds["data_wait"] == 31.0
    assert loop.timer.in_iteration


def test_a_skipped_step_ends_the_iteration_without_counting_a_step(loop: Loop) -> None:
    loop.clock.advance(1.0)
    loop.timer.forward_start()
    loop.clock.advance(1.0)
    loop.timer.forward_end()
    loop.clock.advance(1.0)
    loop.timer.iteration_skipped()
    assert loop.readings.steps == 0
    assert not loop.timer.in_iteration
    assert loop.timer.phase == "data_wait"
    assert loop.readings.phase_seconds["backward"] == 1.0


def test_device_marks_name_each_phase_and_flag_the_step_end(loop: Loop) -> None:
    loop.step()
    assert loop.marks == [
        ("forward", False),
        ("backward", False),
        ("optimizer", False),
        ("data_wait", True),
    ]


class _IdleDevice:
    """A device timer stand-in: its marks, and whether it is between sampling windows."""

    def __init__(self) -> None:
        self.idle = False
        self.marks: list[tuple[str, bool]] = []

    def mark(self, phase: str, step_end: bool = False) -> None:
        self.marks.append((phase, step_end))


def test_an_idle_device_timer_is_not_called_at_the_loops_own_boundaries() -> None:
    """Between sampling windows the device timer records nothing at the forward, backward and
    optimizer boundaries: they do not call it (issue 38); the step end still does, and so do
    named phases."""
    clock = LoopClock(start=100.0)
    readings = Readings(labels={})
    device = _IdleDevice()
    timer = LoopTimer(readings, Heartbeat(clock), clock=clock, device_mark=device.mark)
    device.idle = True
    timer.forward_start()
    timer.forward_end()
    timer.optimizer_start()
    timer.optimizer_end()
    timer.enter_named("eval")
    timer.exit_named()
    assert device.marks == [("data_wait", True), ("eval", False), ("data_wait", False)]
    device.idle = False
    timer.forward_start()
    assert device.marks[-1] == ("forward", False)


def test_timed_iteration_times_each_fetch_on_the_injected_clock() -> None:
    clock = LoopClock()

    def slow() -> Iterator[int]:
        for item in range(3):
            clock.advance(0.25 * (item + 1))
            yield item

    waits: list[float] = []
    ended: list[bool] = []
    items = list(timed_iteration(slow(), waits.append, lambda: ended.append(True), clock=clock))
    assert items == [0, 1, 2]
    assert waits == [0.25, 0.5, 0.75]
    assert ended == [True]


def test_timed_iteration_reports_a_loader_error_and_lets_it_through() -> None:
    def broken() -> Iterator[int]:
        yield 1
        raise RuntimeError("worker died")

    errors: list[BaseException] = []
    iteration = timed_iteration(broken(), lambda _: None, lambda: None, on_error=errors.append)
    assert next(iteration) == 1
    with pytest.raises(RuntimeError, match="worker died"):
        next(iteration)
    assert [str(e) for e in errors] == ["worker died"]


def test_tracked_loader_delegates_len_and_attributes_to_the_loader() -> None:
    class Loader(list[int]):
        dataset = "the dataset"

    loader = Loader([1, 2, 3])
    tracked = TrackedLoader(loader, lambda: iter(loader))
    assert len(tracked) == 3
    assert tracked.dataset == "the dataset"
    assert list(tracked) == [1, 2, 3]
    assert list(tracked) == [1, 2, 3]  # each iter() is a new pass


def test_tracked_loader_continues_a_pass_begun_with_next() -> None:
    tracked = TrackedLoader([1, 2, 3], lambda: iter([1, 2, 3]))
    assert next(tracked) == 1
    assert list(tracked) == [2, 3]


def test_tracked_loader_close_ends_the_latest_pass() -> None:
    def source() -> Iterator[int]:
        yield from range(10)

    tracked = TrackedLoader(range(10), source)
    pass_ = iter(tracked)
    assert next(pass_) == 0
    tracked.close()
    assert list(pass_) == []  # a closed generator yields nothing more
