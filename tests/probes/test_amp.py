"""stabmon.probes.amp: the scale read without a sync, and skipped steps told from its history.

A real ``torch.amp.GradScaler`` on CPU drives the tracker: Inf gradients make it
skip ``optimizer.step()`` and lower the scale, which is the only signal the
tracker has.
"""

from __future__ import annotations

import math

import torch

from stabmon.probes.amp import ScaleTracker, scale_tensor


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


def test_scale_tensor_is_a_float64_copy_of_the_scale_without_get_scale() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert scale_tensor(scaler) is None  # no scale() call yet: nothing to read
    scaler.scale(torch.ones(()))

    scale = scale_tensor(scaler)

    assert scale is not None
    assert scale.dtype == torch.float64 and scale.shape == (1,)
    assert scale.tolist() == [1024.0] == [scaler.get_scale()]


def test_scale_tensor_is_none_for_a_disabled_scaler_or_something_else() -> None:
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    disabled.scale(torch.ones(()))
    assert scale_tensor(disabled) is None
    assert scale_tensor(object()) is None


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
