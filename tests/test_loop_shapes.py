"""Loops as real projects write them: get_batch(), hand updates, complex parts, loader proxies."""

from __future__ import annotations

import logging

import pytest
import torch

import stabmon
from stabmon.detectors.stall import Heartbeat
from stabmon.pipeline.readings import Readings
from stabmon.probes.timing import LoopTimer
from tests.conftest import MonitorFactory
from tests.helpers import scrape, train_step, value


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def test_attach_without_an_optimizer_says_what_to_do(tmp_path: object) -> None:
    with pytest.raises(stabmon.StabmonError, match=r"needs the torch.optim.Optimizer.*lr=0.0"):
        stabmon.attach(_model(), None)  # type: ignore[arg-type]


def test_a_hand_update_loop_is_monitored_through_a_zero_lr_optimizer(
    attach: MonitorFactory,
) -> None:
    model = _model()
    marker = torch.optim.SGD(model.parameters(), lr=0.0)  # the documented recipe
    monitor = attach(model, marker, judge_seconds=0)
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= 0.01 * param.grad  # type: ignore[operator]
        marker.step()
        model.zero_grad()
    assert value(scrape(monitor.metrics_url), "stabmon_steps_total") == 3


def test_complex_loss_is_skipped_and_counted_and_the_scrape_still_works(
    attach: MonitorFactory,
) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, judge_seconds=0)
    train_step(model, optimizer, monitor)
    monitor.observe(torch.tensor(1.0 + 2.0j))
    monitor.observe(1.0 + 2.0j)  # type: ignore[arg-type]
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_internal_errors_total", component="loss") == 2
    assert value(samples, "stabmon_steps_total") == 1


class _WithComplex(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.real = torch.nn.Linear(8, 1)
        self.phase = torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rotated = (x.to(torch.complex64) * self.phase).abs()
        return self.real(rotated)


def test_complex_parameter_is_skipped_with_one_log_line_and_the_rest_are_measured(
    attach: MonitorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    model = _WithComplex()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        monitor = attach(model, optimizer, judge_seconds=0)
        for _ in range(2):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            real_norm = float(torch.nn.utils.get_total_norm([model.real.weight.grad,
                                                             model.real.bias.grad]))  # fmt: skip
            optimizer.step()
            optimizer.zero_grad()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_grad_norm") == pytest.approx(real_norm, rel=1e-5)
    assert value(samples, "stabmon_internal_errors_total", component="grads") == 0
    assert len([r for r in caplog.records if "complex-valued" in r.getMessage()]) == 1


def test_track_keeps_the_loaders_len_and_attributes(attach: MonitorFactory) -> None:
    model = _model()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.01))
    dataset = torch.utils.data.TensorDataset(torch.randn(10, 8))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    tracked = monitor.track(loader)
    assert len(tracked) == 3
    assert tracked.dataset is dataset
    assert [len(batch[0]) for batch in tracked] == [4, 4, 2]
    assert [len(batch[0]) for batch in tracked] == [4, 4, 2]  # each pass is a new iteration


def test_track_close_ends_the_pass_left_early_as_a_generators_close_did(
    attach: MonitorFactory,
) -> None:
    model = _model()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(10, 8)))
    tracked = monitor.track(loader)
    passes = iter(tracked)
    next(passes)
    tracked.close()  # track() returned a generator before; loops that close() it keep working
    with pytest.raises(StopIteration):
        next(passes)
    assert len(list(tracked)) == 10  # a new pass after close() starts from the beginning


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_fetch_between_forward_and_backward_is_data_wait_not_backward() -> None:
    clock = FakeClock()
    readings = Readings(labels={})
    timer = LoopTimer(readings, Heartbeat(clock), clock=clock)
    timer.forward_start()
    clock.now += 1.0
    timer.forward_end()  # backward starts
    clock.now += 5.0  # ...the loop fetches the next batch here, and waits 5 s for it
    timer.loader_wait(5.0)
    clock.now += 2.0  # the backward pass itself
    timer.optimizer_start()
    clock.now += 1.0
    timer.optimizer_end()
    assert readings.phase_seconds["backward"] == 2.0
    assert readings.phase_seconds["data_wait"] == 5.0
    assert readings.phase_seconds["forward"] == 1.0


def test_data_wait_context_times_a_get_batch_call(attach: MonitorFactory) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, judge_seconds=0)

    def get_batch() -> torch.Tensor:
        return torch.randn(4, 8)

    for _ in range(3):
        with monitor.data_wait():
            batch = get_batch()
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_data_wait_seconds_count") == 3
