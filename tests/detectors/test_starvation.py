"""Input starvation: the judgement on blocks, and real loops whose loader starves them."""

from __future__ import annotations

import pytest
import torch
from conftest import MonitorFactory
from helpers import LoopClock, events, scrape, value

from stabmon.detectors.starvation import StarvationDetector


def _feed(detector: StarvationDetector, blocks: list[tuple[float, float]], start: float = 0.0):
    """(wait, seconds) blocks back to back from ``start``; each update's result, in order."""
    now, results = start, []
    for wait, seconds in blocks:
        now += seconds
        results.append(detector.update(end=now, wait=wait, seconds=seconds))
    return results


def test_starvation_detector_stays_quiet_on_a_steady_small_wait() -> None:
    detector = StarvationDetector(share=0.3, window_seconds=30.0)
    results = _feed(detector, [(1.0, 5.0)] * 200)  # 20% of every block, for 1,000 s
    assert all(began is None and ended is None for began, ended in results)
    assert detector.share == pytest.approx(0.2)


def test_starvation_detector_reports_one_episode_and_its_end() -> None:
    detector = StarvationDetector(share=0.3, window_seconds=30.0)
    steady, starved = [(0.25, 5.0)] * 12, [(3.0, 5.0)] * 12  # 5%, then 60%
    results = _feed(detector, steady + starved + steady)
    began = [(i, b) for i, (b, _) in enumerate(results) if b is not None]
    ended = [(i, e) for i, (_, e) in enumerate(results) if e is not None]
    assert len(began) == 1 and len(ended) == 1
    first = began[0][0]
    assert 12 <= first <= 12 + 3  # within 20 s of training time of the stutter's start
    assert ended[0][0] > 24 and ended[0][1].share > 0.3


def test_starvation_detector_waits_for_a_full_window() -> None:
    detector = StarvationDetector(share=0.3, window_seconds=30.0)
    began, _ = detector.update(end=5.0, wait=5.0, seconds=5.0)  # one starved block at start
    assert began is None


@pytest.mark.parametrize("share", [0.0, 1.0, -0.1])
def test_starvation_detector_rejects_a_share_outside_0_1(share: float) -> None:
    with pytest.raises(ValueError, match="share must be between 0 and 1"):
        StarvationDetector(share=share, window_seconds=30.0)


class _Images(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A data set whose reads take ``read_seconds`` on the loop clock; from ``stutter_from``
    on, every ``stutter_every``-th batch waits ``stutter_seconds`` for a starved worker pool
    (the YOLO runs' stutter), until ``stutter_until``."""

    def __init__(self, clock: LoopClock, *, read_seconds: float, stutter_from: int = 10**9,
                 stutter_until: int = 10**9, stutter_every: int = 4,
                 stutter_seconds: float = 0.0, batch: int = 4) -> None:  # fmt: skip
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(4096, 8, generator=generator), torch.randn(4096, 1)
        self.clock, self.read, self.batch = clock, read_seconds, batch
        self.stutter = (stutter_from, stutter_until, stutter_every, stutter_seconds)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.clock.advance(self.read / self.batch)
        start, until, every, seconds = self.stutter
        batch = index // self.batch
        if index % self.batch == 0 and start <= batch < until and batch % every == 0:
            self.clock.advance(seconds)
        return self.x[index], self.y[index]


class _Timed(torch.nn.Module):
    """A model whose training step takes ``step_seconds`` on the loop clock."""

    def __init__(self, clock: LoopClock, step_seconds: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.clock, self.step_seconds = torch.nn.Linear(8, 1), clock, step_seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.step_seconds)
        return self.net(x)  # type: ignore[no-any-return]


def _train(
    attach: MonitorFactory, data: _Images, clock: LoopClock, step_seconds: float
) -> tuple[list[dict[str, object]], list[float], float | None]:
    """An mnist-style loop over ``track(loader)``; the event log, each step's end on the loop
    clock, and the exported gauge just before detach."""
    model = _Timed(clock, step_seconds)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, clock=clock, judge_seconds=0)
    ends: list[float] = []
    for x, y in monitor.track(torch.utils.data.DataLoader(data, batch_size=data.batch)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ends.append(clock.now)
    active = value(scrape(monitor.metrics_url), "stabmon_input_starvation_active")
    monitor.detach()
    return events(monitor.event_log_path), ends, active


def test_a_stuttering_loader_is_an_input_starvation_within_a_minute_and_its_end_is_recorded(
    attach: MonitorFactory,
) -> None:
    """0.1 s steps, 10 ms reads; from batch 300 to 700 every fourth batch waits 2 s."""
    clock = LoopClock()
    data = _Images(clock, read_seconds=0.01, stutter_from=300, stutter_until=700,
                   stutter_seconds=2.0)  # fmt: skip
    records, ends, active = _train(attach, data, clock, step_seconds=0.1)
    starved = [r for r in records if r.get("kind") == "input_starvation"]
    assert len(starved) == 1
    step = starved[0]["step"]
    assert isinstance(step, int) and step >= 300
    assert ends[step] - ends[299] <= 60.0  # caught within a minute of the stutter's start
    assert "num_workers" in str(starved[0]["detail"])
    end = [r for r in records if r["event"] == "input_starvation_end"]
    assert len(end) == 1 and end[0]["first_step"] == step and end[0]["step"] > 700
    assert active == 0


def test_a_steady_small_input_wait_raises_no_input_starvation(attach: MonitorFactory) -> None:
    """A loader a little slow every step (20 ms of a 120 ms step): no anomaly."""
    clock = LoopClock()
    records, _, active = _train(attach, _Images(clock, read_seconds=0.02), clock, 0.1)
    assert [r for r in records if r.get("kind") == "input_starvation"] == []
    assert active == 0


def test_a_loop_whose_fetches_are_not_timed_raises_no_input_starvation_on_cpu(
    attach: MonitorFactory,
) -> None:
    """A trainer whose loader stabmon does not see (Lightning on CPU): the time between steps
    is its own work as much as input wait, so it is not judged as starvation."""
    clock = LoopClock()
    model = _Timed(clock, 0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, clock=clock, judge_seconds=0)
    data = _Images(clock, read_seconds=0.02)
    for x, y in torch.utils.data.DataLoader(data, batch_size=data.batch):  # not track()ed
        clock.advance(0.1)  # the trainer's hooks, logging and progress bar between steps
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    monitor.detach()
    assert [r for r in events(monitor.event_log_path) if r.get("kind") == "input_starvation"] == []
