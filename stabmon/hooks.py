"""Installs and removes the four hooks a Monitor needs; the only user of torch's hook APIs.

Step boundaries come from the optimizer's step pre/post hooks and forward
boundaries from one pre-hook and one post-hook on the root module, never from
hooks on every submodule or parameter. Every handle is kept in one list, so
removing them is a loop and the model and optimizer are left exactly as they
were.

Which objects carry a Monitor is process-wide truth (hooks are process-wide
too), so it is kept in a module-level weak mapping: attaching a second Monitor
to the same model or optimizer is refused, and a garbage-collected model
leaves no entry behind.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from stabmon.errors import AlreadyAttachedError

__all__ = ["HookSet", "unwrap_model"]

_ATTACHED: weakref.WeakKeyDictionary[object, object] = weakref.WeakKeyDictionary()

StepHook = Callable[[torch.optim.Optimizer, tuple[Any, ...], dict[str, Any]], None]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP/DataParallel (``.module``) or compile (``._orig_mod``).

    Parameter names are taken from the unwrapped module, so module groups read
    ``encoder`` rather than ``module.encoder``.
    """
    seen = 0
    while seen < 8:  # wrappers nest (compile of DDP); never loop on a self-reference
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            wrapper_types: tuple[type, ...] = (torch.nn.DataParallel,)
            if torch.distributed.is_available():
                from torch.nn.parallel import DistributedDataParallel

                wrapper_types = (*wrapper_types, DistributedDataParallel)
            inner = model.module if isinstance(model, wrapper_types) else None
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
        seen += 1
    return model


class HookSet:
    """The hooks of one Monitor on one model and one optimizer."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, owner: object
    ) -> None:
        for target, what in ((model, "model"), (optimizer, "optimizer")):
            if target in _ATTACHED:
                raise AlreadyAttachedError(
                    f"a Monitor is already attached to this {what}; call detach() on it first"
                )
        self._model = model
        self._optimizer = optimizer
        self._owner = owner
        self._handles: list[RemovableHandle] = []
        _ATTACHED[model] = owner
        _ATTACHED[optimizer] = owner

    def install(
        self,
        *,
        forward_pre: Callable[[torch.nn.Module, Any], None],
        forward_post: Callable[[torch.nn.Module, Any, Any], None],
        step_pre: StepHook,
        step_post: StepHook,
    ) -> None:
        self._handles.append(self._model.register_forward_pre_hook(forward_pre))
        self._handles.append(self._model.register_forward_hook(forward_post))
        self._handles.append(self._optimizer.register_step_pre_hook(step_pre))
        self._handles.append(self._optimizer.register_step_post_hook(step_post))

    def remove(self) -> None:
        """Remove every hook and release the model and optimizer for another Monitor."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for target in (self._model, self._optimizer):
            if _ATTACHED.get(target) is self._owner:
                del _ATTACHED[target]
