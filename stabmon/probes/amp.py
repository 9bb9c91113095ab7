"""GradScaler loss scale and skipped steps, without reading the scale synchronously.

``GradScaler.get_scale()`` calls ``.item()``: a host-device sync. The scale
lives in a one-element device tensor, so the monitor reads it back
asynchronously like any probe result, once per ``GradScaler.update()`` (once
per iteration, skipped or not). A skipped step is inferred from the scale's
history: GradScaler lowers the scale (by ``backoff_factor``) exactly when it
found Inf/NaN gradients and skipped ``optimizer.step()``.
"""

from __future__ import annotations

import torch

__all__ = ["ScaleTracker", "scale_tensor"]


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


class ScaleTracker:
    """Host-side judge of one scaler's scale history: one value per ``update()``."""

    def __init__(self) -> None:
        self._last: float | None = None
        self.skipped = 0
        self.consecutive_skips = 0

    def update(self, scale: float) -> bool:
        """Record the scale after an ``update()``; True when that iteration's step was skipped."""
        previous, self._last = self._last, scale
        if previous is not None and scale < previous:
            self.skipped += 1
            self.consecutive_skips += 1
            return True
        self.consecutive_skips = 0
        return False

    @property
    def scale(self) -> float | None:
        return self._last
