"""What the policies do to one optimizer step, and undo after it.

A skip must leave the parameters and the optimizer's state exactly as they were:

- an optimizer that takes a device flag (``_step_supports_amp_scaling``: the fused Adam,
  AdamW, SGD and Adagrad, which GradScaler drives this way) gets ``found_inf``, the flag
  GradScaler passes: its kernel leaves parameters, moments and step counts untouched when
  the flag is set, and the host never learns the flag's value (no sync). Where GradScaler
  already set one, the two are combined and GradScaler's put back after the step;
- any other optimizer gets its gradients held back (``grad`` set to None for the step, put
  back after it): torch's optimizers update only parameters that have a gradient, so the
  step changes nothing, not even a step count. This needs the decision on the host, so
  the gate reads the agreed flags then (one sync a step while such a policy is on).

``lr_scale`` multiplies each param group's LR for the step and puts the loop's own value
back after it, every step of the window: an LR scheduler that writes the LR between steps
(or multiplies it, as ``ExponentialLR`` does) keeps its own schedule.

:func:`step_norm` is the check on the step's own gradients: the global norm of the
per-tensor norms the gradient probe measured (before any clip), on the device.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["StepChanges", "computes_gradients_in_step", "step_norm", "takes_device_flag"]


def takes_device_flag(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours ``found_inf`` (what GradScaler checks too)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def computes_gradients_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (LBFGS): it computes the gradients it
    applies inside the step, after the pre-hook checked the ones before it, so no skip can
    hold them back."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin or wrapped step without a signature
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def step_norm(norms: torch.Tensor | list[float], device: torch.device) -> torch.Tensor:
    """The global L2 norm of per-tensor norms, in float64, on ``device`` (0-d; no sync)."""
    if isinstance(norms, torch.Tensor):
        total: torch.Tensor = torch.linalg.vector_norm(norms.detach().double())
        return total
    total = torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float64))
    return total.to(device)


class StepChanges:
    """The changes made to one optimizer step, undone by :meth:`undo` after it."""

    __slots__ = ("_flag", "_held", "_lrs", "_optimizer", "_scaler_flag")

    def __init__(self) -> None:
        self._optimizer: torch.optim.Optimizer | None = None
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lrs: list[tuple[dict[str, Any], Any]] = []
        self._flag: torch.Tensor | None = None
        self._scaler_flag: Any = None

    @property
    def pending(self) -> bool:
        """Whether something is still to undo (a step that raised never ran the post-hook)."""
        return self._optimizer is not None

    def hold_gradients(self, optimizer: torch.optim.Optimizer) -> int:
        """Set every gradient to None for this step; the number held back."""
        self._optimizer = optimizer
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is not None:
                    self._held.append((param, grad))
                    param.grad = None
        return len(self._held)

    def pass_flag(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
        """Hand the optimizer ``found_inf`` (a float32 0-d device tensor), combined with
        GradScaler's when it set one."""
        self._optimizer = optimizer
        existing = getattr(optimizer, "found_inf", None)
        if isinstance(existing, torch.Tensor):
            self._scaler_flag = existing
            flag = torch.maximum(existing, flag.to(existing.device, existing.dtype))
        self._flag = flag
        optimizer.found_inf = flag  # type: ignore[attr-defined]  # GradScaler's attribute

    def scale_lr(self, optimizer: torch.optim.Optimizer, factor: float) -> None:
        """Multiply each param group's LR by ``factor`` for this step."""
        self._optimizer = optimizer
        for group in optimizer.param_groups:
            lr = group["lr"]
            self._lrs.append((group, lr))
            group["lr"] = lr * factor

    def undo(self) -> bool:
        """Put back what was changed: gradients, the LR, GradScaler's flag (or none).
        Whether a held-back gradient was computed anew inside the step (``step(closure)``
        on any optimizer: the step applied those, so nothing was held back)."""
        optimizer, self._optimizer = self._optimizer, None
        recomputed = False
        for param, grad in self._held:
            if param.grad is None:
                param.grad = grad
            else:
                recomputed = True
        self._held.clear()
        for group, lr in self._lrs:
            group["lr"] = lr
        self._lrs.clear()
        flag, self._flag = self._flag, None
        scaler_flag, self._scaler_flag = self._scaler_flag, None
        if optimizer is not None and flag is not None:
            if getattr(optimizer, "found_inf", None) is flag:
                if scaler_flag is not None:
                    optimizer.found_inf = scaler_flag  # type: ignore[attr-defined]  # it deletes it
                else:
                    del optimizer.found_inf  # type: ignore[attr-defined]
        return recomputed
