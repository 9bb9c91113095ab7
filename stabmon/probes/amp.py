"""GradScaler loss scale and skipped steps, without reading the scale synchronously.

``GradScaler.get_scale()`` calls ``.item()``: a host-device sync. The scale
lives in a one-element device tensor, so the monitor reads it back
asynchronously like any probe result, once per ``GradScaler.update()`` (once
per iteration, skipped or not). What a lower scale means is judged on the host
(:mod:`stabmon.detectors.amp`).
"""

from __future__ import annotations

import torch

__all__ = ["scale_tensor"]


def scale_tensor(scaler: object) -> torch.Tensor | None:
    """The scaler's current scale as a 1-element fp64 tensor, or None when disabled or unused."""
    is_enabled = getattr(scaler, "is_enabled", None)
    if is_enabled is not None and not is_enabled():
        return None
    # Private, but the only non-syncing way to the scale (get_scale() calls .item()).
    scale = getattr(scaler, "_scale", None)
    if not isinstance(scale, torch.Tensor):
        return None
    return scale.detach().reshape(1).to(torch.float64)
