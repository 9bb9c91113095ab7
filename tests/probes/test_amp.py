"""stabmon.probes.amp: the scale read without a sync (what it means: tests/detectors/
test_detectors_amp.py)."""

from __future__ import annotations

import torch

from stabmon.probes.amp import scale_tensor


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
