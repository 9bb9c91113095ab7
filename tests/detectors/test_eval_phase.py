"""An evaluation nobody wrapped in mon.phase() is the automatic eval phase, not a stall."""

from __future__ import annotations

import torch

from stabmon.detectors.stall import Heartbeat, StallReport, StallWatchdog
from stabmon.pipeline.readings import Readings
from stabmon.probes.timing import LoopTimer
from tests.conftest import MonitorFactory
from tests.helpers import scrape, train_step, value


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _loop(clock: FakeClock) -> tuple[LoopTimer, StallWatchdog, list[StallReport], Readings]:
    readings = Readings(labels={})
    heartbeat = Heartbeat(clock)
    stalls: list[StallReport] = []
    watchdog = StallWatchdog(heartbeat, stall_seconds=5.0, phase_stall_seconds=100.0,
                             on_stall=stalls.append, on_recover=lambda _: None,
                             clock=clock)  # fmt: skip
    timer = LoopTimer(readings, heartbeat, clock=clock)
    for _ in range(3):  # a few training steps of 0.1 s
        timer.forward_start()
        clock.now += 0.05
        timer.forward_end()
        timer.optimizer_start()
        clock.now += 0.05
        timer.optimizer_end()
    return timer, watchdog, stalls, readings


def test_unwrapped_evaluation_of_thirty_seconds_is_no_stall() -> None:
    clock = FakeClock()
    timer, watchdog, stalls, readings = _loop(clock)
    for _ in range(60):  # 30 s of evaluation forwards, 0.5 s apart, with a 5 s stall limit
        clock.now += 0.5
        timer.eval_forward()
        watchdog.check()
    assert stalls == []
    timer.forward_start()  # training resumes: the evaluation's time is booked as eval
    assert timer.in_iteration
    assert readings.phase_seconds["eval"] == 29.5


def test_a_hang_inside_an_unwrapped_evaluation_is_a_stall_in_phase_eval_past_its_phase_limit() -> (
    None
):
    clock = FakeClock()
    timer, watchdog, stalls, _ = _loop(clock)
    clock.now += 0.5
    timer.eval_forward()
    clock.now += 6.0  # one evaluation forward longer than stall_seconds: the phase limit holds
    watchdog.check()
    assert stalls == []
    clock.now += 95.0  # the evaluation hangs past phase_stall_seconds
    watchdog.check()
    assert [report.phase for report in stalls] == ["eval"]
    assert stalls[0].limit_seconds == 100.0


def test_monitor_books_a_no_grad_evaluation_as_eval_not_data_wait(
    attach: MonitorFactory,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, judge_seconds=0)
    train_step(model, optimizer, monitor)
    with torch.no_grad():
        for _ in range(20):
            model(torch.randn(64, 8))
    model.eval()  # and in eval() mode with gradients enabled
    model(torch.randn(64, 8))
    model.train()
    train_step(model, optimizer, monitor)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_phase_seconds_total", phase="eval") > 0
    assert value(samples, "stabmon_steps_total") == 2
