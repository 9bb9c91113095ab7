"""Throughput, MFU and slowdowns through a real Monitor and a real scrape, on a fake loop clock.

The loop clock (``attach(..., clock=clock)``) is a counter the loop below advances by hand:
a slow input pipeline or forward is a bigger advance, never a sleep.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from conftest import MonitorFactory
from helpers import LoopClock, scrape, tiny_model, value
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import stabmon
from stabmon.config import ThroughputConfig
from stabmon.export.collector import ReadingsCollector
from stabmon.pipeline.readings import Readings
from stabmon.pipeline.throughput import ThroughputWatch
from stabmon.shared.log import LogLimiter

LABELS = frozenset({("rank", "0"), ("run", "r")})


@pytest.fixture
def clock() -> LoopClock:
    return LoopClock()


class Paced(torch.nn.Module):
    """A model whose forward takes ``forward_seconds`` of loop-clock time."""

    def __init__(self, clock: LoopClock) -> None:
        super().__init__()
        self.inner = tiny_model()
        self.clock = clock
        self.forward_seconds = 0.03

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.forward_seconds)
        return self.inner(x)


# Short blocks and hold on the fake clock: the rule is the same, the loop is shorter.
SETTINGS = {
    "throughput.slowdown_block_seconds": 2.0,
    "throughput.slowdown_hold_seconds": 30.0,
    "throughput.slowdown_warmup_steps": 50,
    "throughput.flops_measure_step": 0,
}

M = TypeVar("M", bound=torch.nn.Module)


def attached(
    attach: MonitorFactory, model: M, **settings: Any
) -> tuple[stabmon.Monitor, M, torch.optim.Optimizer]:
    """``model``, an SGD optimizer over it, and a Monitor attached to both."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return attach(model, optimizer, **settings), model, optimizer


def train(
    monitor: stabmon.Monitor,
    model: Paced,
    optimizer: torch.optim.Optimizer,
    clock: LoopClock,
    steps: int,
    *,
    slow_from: int,
    slower_input: bool = False,
    slower_forward: bool = False,
) -> Iterator[int]:
    """get_batch() loop: input wait 0.02 s, forward 0.03 s, backward 0.04 s, step 0.01 s."""
    for step in range(steps):
        clock.advance(0.02 + (0.02 if slower_input and step >= slow_from else 0.0))  # get_batch()
        batch = torch.randn(4, 8)
        model.forward_seconds = 0.03 + (0.02 if slower_forward and step >= slow_from else 0.0)
        loss = model(batch).pow(2).mean()
        clock.advance(0.04)
        loss.backward()
        clock.advance(0.01)
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss, samples=4)
        yield step


def anomalies(path: Path | None) -> list[dict[str, object]]:
    assert path is not None
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r["event"] == "anomaly" and r["kind"] == "slowdown"]


def test_monitor_raises_one_slowdown_naming_data_wait_when_get_batch_slows_from_step_k(
    attach: MonitorFactory, clock: LoopClock
) -> None:
    monitor, model, optimizer = attached(attach, Paced(clock), clock=clock, **SETTINGS)
    onset = 500
    found_at = None
    for step in train(monitor, model, optimizer, clock, 1200, slow_from=onset, slower_input=True):
        if found_at is None and anomalies(monitor.event_log_path):
            found_at = step

    [anomaly] = anomalies(monitor.event_log_path)
    assert anomaly["phase"] == "data_wait"
    assert anomaly["ratio"] == pytest.approx(1.2, abs=0.02)
    # Within the hold time (30 s = 250 slow steps of 0.12 s) and the block being closed.
    assert found_at is not None and onset + 250 <= found_at <= onset + 250 + 2 * 17
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_anomalies_total", kind="slowdown") == 1
    assert value(samples, "stabmon_slowdown_active", phase="data_wait") == 1
    assert value(samples, "stabmon_slowdown_active", phase="forward") == 0
    assert value(samples, "stabmon_step_time_baseline_seconds") == pytest.approx(0.1, rel=0.01)


def test_monitor_names_forward_when_the_forward_slows(
    attach: MonitorFactory, clock: LoopClock
) -> None:
    monitor, model, optimizer = attached(attach, Paced(clock), clock=clock, **SETTINGS)

    for _ in train(monitor, model, optimizer, clock, 1000, slow_from=500, slower_forward=True):
        pass

    assert [a["phase"] for a in anomalies(monitor.event_log_path)] == ["forward"]


def test_monitor_leaves_eval_phases_and_a_clean_loop_alone(
    attach: MonitorFactory, clock: LoopClock
) -> None:
    monitor, model, optimizer = attached(attach, Paced(clock), clock=clock, **SETTINGS)

    for step in train(monitor, model, optimizer, clock, 1500, slow_from=10**9):
        if step % 300 == 299:
            with monitor.phase("eval"), torch.no_grad():  # a 60 s evaluation
                clock.advance(60.0)

    assert anomalies(monitor.event_log_path) == []
    assert value(scrape(monitor.metrics_url), "stabmon_anomalies_total", kind="slowdown") == 0


def test_monitor_does_not_judge_the_first_steps_after_a_resume(
    attach: MonitorFactory, clock: LoopClock
) -> None:
    monitor, model, optimizer = attached(attach, Paced(clock), clock=clock, **SETTINGS)
    for _ in train(monitor, model, optimizer, clock, 400, slow_from=10**9):
        pass

    monitor.load_state_dict(monitor.state_dict())  # a resume: from here the pace is new
    for _ in train(monitor, model, optimizer, clock, 600, slow_from=0, slower_forward=True):
        pass

    assert anomalies(monitor.event_log_path) == []


def test_track_counts_samples_and_tokens_from_each_batch(attach: MonitorFactory) -> None:
    monitor, model, optimizer = attached(attach, tiny_model())
    batches = [{"input_ids": torch.zeros(6, 10, dtype=torch.long), "x": torch.randn(6, 8)}] * 3

    for batch in monitor.track(batches):
        model(batch["x"]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_samples_total") == 18
    assert value(samples, "stabmon_tokens_total") == 180


def test_observe_samples_replaces_what_track_counts(attach: MonitorFactory) -> None:
    monitor, model, optimizer = attached(attach, tiny_model())

    for x in monitor.track([torch.randn(5, 8)] * 4):
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss, samples=2, tokens=7)

    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_samples_total") == 5 + 2 * 4  # track's first batch, then observe
    assert value(samples, "stabmon_tokens_total") == 7 * 4


def test_model_flops_are_counted_once_and_mfu_is_not_exported_on_cpu(
    attach: MonitorFactory,
) -> None:
    settings = {"throughput.flops_measure_step": 2, "throughput.slowdown_block_seconds": 1e-6}
    monitor, model, optimizer = attached(attach, tiny_model(), **settings)
    for _ in range(6):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    # Linear 8->16, 16->16, 16->1 on a batch of 4: forward 2*4*(128+256+16); backward the
    # weight gradients of all three and the input gradients of the last two.
    per_step = 2 * 4 * (128 + 256 + 16) + 2 * 4 * (128 + 256 + 16) + 2 * 4 * (256 + 16)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_model_flops_total") == per_step * 4  # the counted step on
    assert value(samples, "stabmon_mfu_ratio") is None
    assert value(samples, "stabmon_peak_flops_per_second") is None


def test_a_flop_count_left_open_by_a_loop_that_stops_mid_step_is_closed_at_detach(
    tmp_path: Path,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = stabmon.attach(model, optimizer, port=0, run_dir=str(tmp_path))
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()  # step 3's forward starts the count

    monitor.detach()

    # A dispatch mode left behind would make this raise ("found no compiled frames").
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager", fullgraph=True)
    assert compiled(torch.ones(2)).tolist() == [3.0, 3.0]
    torch._dynamo.reset()


class Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x).relu()


def test_flops_are_counted_when_a_compiled_part_runs_inside_an_eager_loop(
    attach: MonitorFactory,
) -> None:
    settings = {"throughput.slowdown_block_seconds": 1e-6}
    monitor, model, optimizer = attached(attach, tiny_model(), **settings)
    block = Residual()
    block.compile(backend="eager", fullgraph=True)  # a counting mode would make it raise
    for _ in range(6):
        out = model(block(torch.randn(4, 8)))
        out.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    # Replayed on meta tensors through the attached model only: its three linear layers, and
    # the first one's input gradient too (the input comes from the block, which trains).
    per_step = 3 * 2 * 4 * (128 + 256 + 16)
    assert value(scrape(monitor.metrics_url), "stabmon_model_flops_total") == per_step * 3
    torch._dynamo.reset()


def exposition(readings: Readings) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """What a scrape of these readings would hold (the exporter's own collector)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReadingsCollector(readings, {}))
    text = generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def watch_on(device_name: str | None, readings: Readings, **settings: Any) -> ThroughputWatch:
    """A watch as the Monitor builds it on a GPU called ``device_name`` (no CUDA needed)."""
    config = ThroughputConfig(slowdown_block_seconds=1.0, **settings)
    return ThroughputWatch(
        config, readings, now=0.0, device_name=device_name, parameter_dtype=torch.bfloat16,
        model=tiny_model(), anomaly=lambda *a, **k: None, write=lambda *a, **k: None,
        global_step=lambda: readings.steps, limiter=LogLimiter(),
    )  # fmt: skip


def test_mfu_on_a_known_gpu_is_flops_per_step_times_steps_over_training_time_and_peak() -> None:
    readings = Readings(labels={"rank": "0", "run": "r"})
    watch = watch_on("NVIDIA H100 80GB HBM3", readings, flops_per_step=1e12)
    watch.forward_start("cuda", (), {})  # the parameters are bf16: the bf16 peak applies
    for _ in range(10):  # ten 0.1 s steps in a block, plus a 5 s eval that is not training
        for phase in ("data_wait", "forward", "backward", "optimizer"):
            readings.add_phase_time(phase, 0.025)
        readings.steps += 1
    readings.add_phase_time("eval", 5.0)
    watch.step_end(6.0)

    samples = exposition(readings)
    assert samples[("stabmon_peak_flops_per_second", LABELS)] == 989.5e12
    assert samples[("stabmon_mfu_ratio", LABELS)] == pytest.approx(1e12 * 10 / 1.0 / 989.5e12)


def test_mfu_follows_the_configured_peak_and_dtype() -> None:
    readings = Readings(labels={"rank": "0", "run": "r"})
    watch = watch_on("NVIDIA A100-SXM4-80GB", readings, flops_per_step=1e12, mfu_dtype="tf32")
    assert readings.peak_flops == 156e12
    custom = Readings(labels={"rank": "0", "run": "r"})
    watch_on("Some Future GPU", custom, flops_per_step=1e12, peak_flops=2e15)
    assert custom.peak_flops == 2e15
    assert watch.flops_step == -1  # FLOPs and dtype given: nothing to learn at a step


def test_mfu_is_not_exported_for_a_gpu_missing_from_the_table() -> None:
    readings = Readings(labels={"rank": "0", "run": "r"})
    watch = watch_on("NVIDIA Imaginary X1", readings, flops_per_step=1e12)
    watch.forward_start("cuda", (), {})
    readings.add_phase_time("forward", 1.0)
    readings.steps += 10
    watch.step_end(2.0)

    samples = exposition(readings)
    assert ("stabmon_mfu_ratio", LABELS) not in samples
    assert ("stabmon_peak_flops_per_second", LABELS) not in samples


def test_mfu_on_cpu_follows_a_configured_peak() -> None:
    readings = Readings(labels={"rank": "0", "run": "r"})
    watch = watch_on(None, readings, flops_per_step=1e9, peak_flops=1e11)
    watch.forward_start("cpu", (), {})
    readings.add_phase_time("forward", 2.0)
    readings.steps += 10
    watch.step_end(3.0)

    samples = exposition(readings)
    assert samples[("stabmon_peak_flops_per_second", LABELS)] == 1e11
    assert samples[("stabmon_mfu_ratio", LABELS)] == pytest.approx(1e9 * 10 / 2.0 / 1e11)


class SlowingDataset(torch.utils.data.Dataset[torch.Tensor]):
    """Each sample takes 5 ms of loop-clock time to load, 10 ms from ``slow_from`` samples on."""

    def __init__(self, clock: LoopClock, size: int, slow_from: int) -> None:
        self.clock, self.size, self.slow_from = clock, size, slow_from

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        self.clock.advance(0.010 if index >= self.slow_from else 0.005)
        return torch.randn(8)


def test_monitor_names_data_wait_when_a_dataloader_behind_track_slows(
    attach: MonitorFactory, clock: LoopClock
) -> None:
    monitor, model, optimizer = attached(attach, Paced(clock), clock=clock, **SETTINGS)
    loader = torch.utils.data.DataLoader(SlowingDataset(clock, 4 * 1000, 4 * 500), batch_size=4)

    for batch in monitor.track(loader):  # steps of 0.09 s, 0.11 s once input takes 0.04 s
        model(batch).pow(2).mean().backward()
        clock.advance(0.04)
        optimizer.step()
        optimizer.zero_grad()

    [anomaly] = anomalies(monitor.event_log_path)
    assert anomaly["phase"] == "data_wait"
    assert value(scrape(monitor.metrics_url), "stabmon_samples_total") == 4000


def test_observe_ignores_samples_that_are_not_plain_ints_without_reading_them(
    attach: MonitorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    monitor, model, optimizer = attached(attach, tiny_model())

    monitor.observe(samples=torch.tensor(4), tokens=-1)  # a tensor would need a read

    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_samples_total") == 0
    assert value(samples, "stabmon_tokens_total") == 0
    assert value(samples, "stabmon_internal_errors_total", component="hooks") == 0
    assert "observe(samples=<Tensor>) ignored: pass a Python int" in caplog.text
    assert "observe(tokens=-1) ignored" in caplog.text
