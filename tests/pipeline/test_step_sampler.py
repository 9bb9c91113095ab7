"""stabmon.pipeline.step_sampler: the event log's step_sample records, which `stabmon report` plots,
from real training."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import events, tiny_model, train_step

import stabmon


def _samples(monitor: stabmon.Monitor) -> list[dict[str, object]]:
    return [r for r in events(monitor.event_log_path) if r["event"] == "step_sample"]


@pytest.mark.parametrize("judge_seconds", [0, 3600])  # each step at its end; all at detach
def test_step_sample_is_written_every_sample_every_steps_with_that_steps_loss(
    tmp_path: Path, judge_seconds: float
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, run_dir=str(tmp_path), run_id="r", sample_every=10,
        judge_seconds=judge_seconds,
    ) as monitor:  # fmt: skip
        losses = [train_step(model, optimizer, monitor).item() for _ in range(35)]

    samples = _samples(monitor)

    assert [sample["step"] for sample in samples] == [0, 10, 20, 30]
    for sample in samples:
        assert isinstance(sample["step"], int)
        assert sample["loss"] == pytest.approx(losses[sample["step"]], rel=1e-5)
        assert isinstance(sample["grad_norm"], float) and sample["grad_norm"] > 0
        assert set(sample["module_grad_norms"]) == {"0", "2", "4"}  # type: ignore[arg-type]  # a JSON object
    assert all(isinstance(s["step_seconds"], float) and s["step_seconds"] > 0 for s in samples[1:])
    assert all(isinstance(s["data_wait_seconds"], float) for s in samples[1:])


def test_step_sample_is_written_when_no_loss_is_observed(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, run_dir=str(tmp_path), run_id="r", sample_every=10
    ) as monitor:
        for _ in range(25):
            train_step(model, optimizer)  # no observe(): gradient norms only

    samples = _samples(monitor)

    assert [sample["step"] for sample in samples] == [0, 10, 20]  # the last kept at detach
    assert all(sample["loss"] is None and sample["grad_norm"] for sample in samples)


def test_step_sample_takes_the_latest_norm_when_measuring_every_few_steps(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, run_dir=str(tmp_path), run_id="r", sample_every=10,
        measure_every=7,
    ) as monitor:  # fmt: skip
        for _ in range(35):
            train_step(model, optimizer, monitor)

    samples = _samples(monitor)

    assert [sample["step"] for sample in samples] == [0, 10, 20, 30]
    assert all(isinstance(sample["grad_norm"], float) for sample in samples)


def test_step_sample_size_is_bounded_by_max_modules(tmp_path: Path) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(100)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, run_dir=str(tmp_path), run_id="r", sample_every=5
    ) as monitor:
        for _ in range(10):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert monitor.event_log_path is not None

    lines = [
        line for line in monitor.event_log_path.read_text().splitlines() if '"step_sample"' in line
    ]

    assert len(lines) == 2
    assert all(len(line) < 2048 for line in lines)
    last = [e for e in events(monitor.event_log_path) if e["event"] == "step_sample"][-1]
    assert len(last["module_grad_norms"]) <= 33  # 32 and "other"


def test_step_samples_keep_their_own_step_times_when_many_windows_wait(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, run_dir=str(tmp_path), run_id="r", sample_every=1,
        judge_seconds=3600,  # only full window marks (and detach) make it judge
    ) as monitor:  # fmt: skip
        for step in range(160):
            if step % 2:
                time.sleep(0.05)  # odd steps wait 50 ms for their input
            train_step(model, optimizer, monitor)

    samples = _samples(monitor)

    assert [sample["step"] for sample in samples] == list(range(160))
    # Each record has its own step's time, not a mean over the windows judged with it (a mean
    # would be about 25 ms). Only lower bounds: a sleep lasts at least as long as asked, while
    # an un-slept step may take any time on a busy machine.
    slow = [sample for sample in samples[1:] if sample["step"] % 2 == 1]
    assert len(slow) == 80
    for sample in slow:
        assert sample["step_seconds"] >= 0.05, sample
        assert sample["data_wait_seconds"] >= 0.05, sample
