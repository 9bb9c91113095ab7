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
The wrappers are process-wide (so is ``torch.nn.utils``) and reference counted:
installed when the first watcher arrives, restored when the last one leaves, so
``detach()`` of the last Monitor leaves torch exactly as it found it. A wrapper
that somebody else wrapped in turn cannot be taken out of their chain: it is
left in place and, without watchers, only calls the original. Watchers are held
weakly and told apart by the parameters they own, so several Monitors in one
process never see each other's clipping. Nothing of this reaches a model, so
``torch.save(model)`` is unaffected.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["ClipWatch", "clipping_wrapped", "watch_clipping"]

#: (parameters being clipped, max_norm): the watcher measures and remembers.
ClipCallback = Callable[[Sequence[torch.Tensor], float], None]


class ClipWatch:
    """One watcher's registration; :meth:`remove` ends it (idempotent)."""

    def __init__(self, owns: Callable[[torch.Tensor], bool], callback: ClipCallback) -> None:
        self._owns = owns
        self._callback = callback
        self._removed = False

    def remove(self) -> None:
        if not self._removed:
            self._removed = True
            _REGISTRY.remove(self)

    def _notify(self, params: Sequence[torch.Tensor], max_norm: float) -> None:
        for param in params:  # the first parameter with a gradient decides ownership
            if param.grad is not None:
                if self._owns(param):
                    self._callback(params, max_norm)
                return


class _Registry:
    """Installed wrappers and their watchers (process-wide, like the functions they wrap)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchers: list[weakref.ref[ClipWatch]] = []
        #: (namespace, attribute, original, wrapper) of every installed wrapper.
        self._installed: list[tuple[Any, str, Any, Any]] = []

    def add(self, watch: ClipWatch) -> None:
        with self._lock:
            self._watchers = [ref for ref in self._watchers if ref() is not None]
            if not self._installed:
                self._install()
            self._watchers.append(weakref.ref(watch))

    def remove(self, watch: ClipWatch) -> None:
        with self._lock:
            self._watchers = [ref for ref in self._watchers if ref() not in (None, watch)]
            if not self._watchers:
                self._uninstall()

    def notify(self, parameters: Any, max_norm: Any) -> None:
        watchers = [watch for ref in self._watchers if (watch := ref()) is not None]
        if not watchers:
            return
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        limit = float(max_norm)
        for watch in watchers:
            watch._notify(params, limit)

    @property
    def installed(self) -> bool:
        return bool(self._installed)

    def _install(self) -> None:
        from torch.nn.utils import clip_grad

        internal = clip_grad._clip_grads_with_norm_
        wrapped = _wrap_clip_with_norm(internal, self)
        targets: list[tuple[Any, str, Any, Any]] = [(clip_grad, "_clip_grads_with_norm_",
                                                     internal, wrapped)]  # fmt: skip
        public = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
        if public is internal:
            targets.append((torch.nn.utils, "clip_grads_with_norm_", public, wrapped))
        fsdp = _fsdp_class()
        if fsdp is not None and "clip_grad_norm_" in vars(fsdp):
            method = vars(fsdp)["clip_grad_norm_"]
            targets.append((fsdp, "clip_grad_norm_", method, _wrap_fsdp(method, self)))
        for namespace, name, _, wrapper in targets:
            setattr(namespace, name, wrapper)
        self._installed = targets

    def _uninstall(self) -> None:
        for namespace, name, original, wrapper in self._installed:
            if vars(namespace).get(name) is wrapper:  # else somebody wrapped ours: leave theirs
                setattr(namespace, name, original)
        self._installed = []


def _wrap_clip_with_norm(original: Callable[..., Any], registry: _Registry) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip_grads_with_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        total_norm: torch.Tensor,
        foreach: bool | None = None,
    ) -> None:
        if not isinstance(parameters, torch.Tensor):
            parameters = list(parameters)  # a generator is read once: by us, then passed on
        _notify(registry, parameters, max_norm)
        return original(parameters, max_norm, total_norm, foreach)  # type: ignore[no-any-return]  # returns None

    return clip_grads_with_norm_


def _wrap_fsdp(original: Callable[..., Any], registry: _Registry) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip_grad_norm_(self: torch.nn.Module, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        _notify(registry, list(self.parameters()), max_norm)
        return original(self, max_norm, *args, **kwargs)

    return clip_grad_norm_


def _notify(registry: _Registry, parameters: Any, max_norm: Any) -> None:
    # The watcher's callback contains its own failures; this guards the dispatch itself.
    try:
        registry.notify(parameters, max_norm)
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


_REGISTRY = _Registry()


def watch_clipping(owns: Callable[[torch.Tensor], bool], callback: ClipCallback) -> ClipWatch:
    """Call ``callback(params, max_norm)`` before each clip of parameters that ``owns`` claims.

    The caller keeps the returned :class:`ClipWatch` alive (it is held weakly here)
    and calls :meth:`ClipWatch.remove` when done.
    """
    watch = ClipWatch(owns, callback)
    _REGISTRY.add(watch)
    return watch


def clipping_wrapped() -> bool:
    """Whether stabmon's clip wrappers are installed now (tests check detach restores torch)."""
    return _REGISTRY.installed
