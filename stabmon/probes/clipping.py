"""Sees gradient clipping happen, so gradients are measured *before* it scales them.

Almost every large-model loop clips (``torch.nn.utils.clip_grad_norm_(params, 1.0)``
just before ``optimizer.step()``), and the optimizer's step pre-hook runs after the
clip: a norm measured there is ``min(true norm, max_norm)``, a flat line that hides
every gradient spike. Torch has no hook for clipping, so this module wraps the
functions that clip, where the loop looks them up at call time:

- ``torch.nn.utils.clip_grad._clip_grads_with_norm_``: what ``clip_grad_norm_``
  calls once it has the total norm, and what ``torch.nn.utils.clip_grads_with_norm_``
  is (after ``get_total_norm``); Lightning's precision plugin, Hugging Face's
  Trainer and accelerate all reach it through ``clip_grad_norm_``;
- the public name ``torch.nn.utils.clip_grads_with_norm_`` (bound separately);
- FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``, which clips by itself.

The wrapper calls each watcher whose parameters are being clipped, with the
parameters and ``max_norm``, and then the original: the watcher measures the
gradients (the same fused pass it would run at the step, moved earlier; never
a sync) and records ``max_norm`` for the clip coefficient.

Design
------
The wrappers are process-wide (so is ``torch.nn.utils``) and reference counted
(:class:`stabmon.shared.wrapping.SharedWrap`): installed when the first watcher arrives,
restored when the last one leaves, so ``detach()`` of the last Monitor leaves torch
exactly as it found it. A wrapper that somebody else wrapped in turn cannot be taken
out of their chain: it is left in place and, without watchers, only calls the
original. Watchers hold their Monitor weakly and are told apart by the parameters
they own, so several Monitors in one process never see each other's clipping.
Nothing of this reaches a model, so ``torch.save(model)`` is unaffected.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from stabmon.shared.wrapping import Hold, Patch, SharedWrap

__all__ = ["ClipWatch", "clipping_wrapped", "watch_clipping"]

#: (parameters being clipped, max_norm): the watcher measures and remembers.
ClipCallback = Callable[[Sequence[torch.Tensor], float], None]


class ClipWatch:
    """One watcher's registration; :meth:`remove` ends it (idempotent)."""

    def __init__(self, owns: Callable[[torch.Tensor], bool], callback: ClipCallback) -> None:
        self._owns = owns
        self._callback = callback
        self._hold: Hold[ClipWatch] | None = None

    def remove(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()

    def _notify(self, params: Sequence[torch.Tensor], max_norm: float) -> None:
        for param in params:  # the first parameter with a gradient decides ownership
            if param.grad is not None:
                if self._owns(param):
                    self._callback(params, max_norm)
                return


def _patches(wrap: SharedWrap[ClipWatch]) -> list[Patch]:
    from torch.nn.utils import clip_grad

    internal = clip_grad._clip_grads_with_norm_
    wrapped = _wrap_clip_with_norm(internal, wrap)
    patches = [Patch(clip_grad, "_clip_grads_with_norm_", wrapped)]
    if getattr(torch.nn.utils, "clip_grads_with_norm_", None) is internal:
        patches.append(Patch(torch.nn.utils, "clip_grads_with_norm_", wrapped))
    fsdp = _fsdp_class()
    if fsdp is not None and "clip_grad_norm_" in vars(fsdp):
        method = vars(fsdp)["clip_grad_norm_"]
        patches.append(Patch(fsdp, "clip_grad_norm_", _wrap_fsdp(method, wrap)))
    return patches


def _wrap_clip_with_norm(
    original: Callable[..., Any], wrap: SharedWrap[ClipWatch]
) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip_grads_with_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        total_norm: torch.Tensor,
        foreach: bool | None = None,
    ) -> None:
        if not isinstance(parameters, torch.Tensor):
            parameters = list(parameters)  # a generator is read once: by us, then passed on
        inside = _INSIDE
        if inside.now:  # an outer stabmon wrapper on this thread has notified
            return original(parameters, max_norm, total_norm, foreach)  # type: ignore[no-any-return]  # returns None
        inside.now = True
        try:
            _notify(wrap, parameters, max_norm)
            return original(parameters, max_norm, total_norm, foreach)  # type: ignore[no-any-return]  # returns None
        finally:
            inside.now = False

    return clip_grads_with_norm_


def _wrap_fsdp(original: Callable[..., Any], wrap: SharedWrap[ClipWatch]) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip_grad_norm_(self: torch.nn.Module, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        inside = _INSIDE
        if inside.now:
            return original(self, max_norm, *args, **kwargs)
        inside.now = True
        try:
            _notify(wrap, list(self.parameters()), max_norm)
            return original(self, max_norm, *args, **kwargs)
        finally:
            inside.now = False

    return clip_grad_norm_


class _Inside(threading.local):
    """Whether this thread is inside a clip that stabmon already notified.

    One for every generation of wrappers: one left inside somebody else's chain at the
    last detach is still called after the next attach puts a new one over theirs, and
    one clip must be measured once. The wrappers test and set it inline (no context
    manager): a clip is once a step in most loops, and the check allocates nothing.
    """

    now = False


_INSIDE = _Inside()


def _notify(wrap: SharedWrap[ClipWatch], parameters: Any, max_norm: Any) -> None:
    watchers = wrap.users
    if not watchers:
        return
    # The watcher's callback contains its own failures; this guards the dispatch itself.
    try:
        if isinstance(parameters, torch.Tensor):
            params = [parameters]
        else:  # a list already, made by the wrapper: no second copy
            params = parameters if type(parameters) is list else list(parameters)
        limit = float(max_norm)
        for watch in watchers:
            watch._notify(params, limit)
    except Exception:  # never break the user's clipping call
        pass


def _fsdp_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    return FullyShardedDataParallel


_WRAP: SharedWrap[ClipWatch] = SharedWrap(_patches)


def watch_clipping(owns: Callable[[torch.Tensor], bool], callback: ClipCallback) -> ClipWatch:
    """Call ``callback(params, max_norm)`` before each clip of parameters that ``owns`` claims.

    The caller calls :meth:`ClipWatch.remove` when done (``HookSet.keep`` does, at detach).
    """
    watch = ClipWatch(owns, callback)
    watch._hold = _WRAP.attach(watch)
    return watch


def clipping_wrapped() -> bool:
    """Whether stabmon's clip wrappers are installed now (tests check detach restores torch)."""
    return _WRAP.installed
