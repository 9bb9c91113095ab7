"""stabmon.detectors.amp: skipped steps read from the GradScaler's scale.

A real ``torch.amp.GradScaler`` on CPU drives the tracker: Inf gradients make it skip
``optimizer.step()`` and lower the scale, which is the only signal the tracker has.

Host values go in as the readback delivers them (tests/judges.py); the records are read
back from the real event log."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from stabmon.detectors.amp import ScaleTracker
from stabmon.probes.amp import scale_tensor
from tests.judges import Judges


def test_amp_scale_counts_each_scale_drop_as_a_skipped_step_and_raises_one_anomaly_per_run(
    tmp_path: Path,
) -> None:
    harness = Judges(tmp_path, amp_skip_run=3)
    scale = 65536.0
    harness.scale(0, scale)
    for step in range(1, 6):
        scale /= 2
        harness.scale(step, scale)
    assert harness.readings.amp_skipped_steps == 5
    assert harness.readings.amp_loss_scale == scale
    assert [r["consecutive"] for r in harness.records("amp_skip")] == [1, 2, 3, 4, 5]
    (anomaly,) = harness.anomalies("nonfinite_grad")
    assert (anomaly["source"], anomaly["step"]) == ("amp_skip_run", 3)


def _scaler_step(
    scaler: torch.amp.GradScaler, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
    poison: bool
) -> float:  # fmt: skip
    """One scaled step; returns the scale as stabmon reads it after ``update()``."""
    optimizer.zero_grad()
    loss = model(torch.ones(1, 2)).sum()
    if poison:
        loss = loss * math.inf
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scale = scale_tensor(scaler)
    assert scale is not None
    return float(scale[0])


def test_scale_tracker_counts_the_steps_a_real_grad_scaler_skipped() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    tracker = ScaleTracker()

    skipped = [
        tracker.update(_scaler_step(scaler, model, optimizer, poison=poison))
        for poison in (False, True, True, False, True)
    ]

    # The first value has nothing to compare with; later Inf steps lower the scale.
    assert skipped == [False, True, True, False, True]
    assert tracker.skipped == 3
    assert tracker.consecutive_skips == 1
    assert tracker.scale == scaler.get_scale()


def test_scale_tracker_takes_a_steady_or_growing_scale_as_no_skip() -> None:
    tracker = ScaleTracker()
    assert tracker.scale is None

    results = [tracker.update(scale) for scale in (8.0, 8.0, 16.0, 4.0, 2.0, 2.0)]

    assert results == [False, False, False, True, True, False]
    assert (tracker.skipped, tracker.consecutive_skips, tracker.scale) == (2, 0, 2.0)
