"""Installs and removes the hooks a Monitor needs; the only user of torch's hook APIs.

Step boundaries come from the optimizer's step pre/post hooks and forward
boundaries from one pre-hook and one post-hook on the root module, never from
hooks on every submodule or parameter. GradScaler has no hook API, so its
``update`` is wrapped on the instance (once per iteration, skipped or not) and
restored on removal. Every handle is kept in one list, so removing them is a
loop and the model, optimizer and scaler are left exactly as they were.

Under torch.compile a forward hook is a constant no-op in traced code (no graph
break, so ``fullgraph=True`` works), while the optimizer's step hooks run
outside the graph (one graph break at each end of a compiled ``optimizer.step()``):
a step that stabmon did not see would be a lost measurement and a false stall.

Hooks hold the Monitor weakly and are inert when copied or pickled: EMA and SWA
code deep-copies the model mid-run (``AveragedModel``), and ``torch.save(model)``
pickles its hooks; neither may drag the Monitor, its threads and locks along.

Which objects carry a Monitor is process-wide truth (hooks are process-wide
too), so it is kept in a module-level weak mapping: attaching a second Monitor
to the same model or optimizer is refused while the first is alive.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from stabmon.errors import AlreadyAttachedError

__all__ = ["HookSet", "unwrap_model"]

_ATTACHED: weakref.WeakKeyDictionary[object, object] = weakref.WeakKeyDictionary()


class _InertHook:
    """What a stabmon hook becomes in a copy or an unpickled model: does nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _WeakHook:
    """Calls a bound method through a weak reference; copies and pickles are inert.

    It holds a weak reference to the method's object and the plain function, not a
    ``WeakMethod``: that one is a Python-level call building a bound method at every
    hook call, four times a step.
    """

    __slots__ = ("_function", "_outside_graph", "_target")

    def __init__(self, method: Callable[..., None], *, outside_graph: bool = False) -> None:
        self._target = weakref.ref(method.__self__)  # type: ignore[attr-defined]  # a bound method
        self._function: Callable[..., None] = method.__func__  # type: ignore[attr-defined]  # idem
        self._outside_graph = outside_graph

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        # torch.compiler.is_compiling(), inlined: one Python call fewer at four hooks a step.
        if _is_dynamo_compiling() or _export_state._is_compiling_flag:
            if self._outside_graph:
                _call_outside_graph(self._target, self._function, args, kwargs)
            return  # otherwise a constant no-op in traced code, so no graph break
        target = self._target()
        if target is not None:
            self._function(target, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _InertHook:
        return _InertHook()

    def __reduce__(self) -> tuple[type[_InertHook], tuple[()]]:
        return (_InertHook, ())


class _WrappedUpdate:
    """``GradScaler.update`` followed by a callback; copies and pickles get the plain method."""

    def __init__(self, original: Callable[..., None], after: Callable[[], None]) -> None:
        self._original = original  # the class's update, bound to the scaler
        self._after = _WeakHook(after)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self._original(*args, **kwargs)
        self._after()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # copy registers the new scaler in memo before copying its state: bind to it.
        copy = memo.get(id(getattr(self._original, "__self__", None)))
        return getattr(copy, "update") if copy is not None else self._original  # noqa: B009

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        # A pickled bound method unpickles as the class's update of the new scaler.
        return (_identity, (self._original,))


def _call(
    target: weakref.ref[Any],
    function: Callable[..., None],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    owner = target()
    if owner is not None:
        function(owner, *args, **kwargs)


# Dynamo does not trace a disabled function: it breaks the graph there and calls it eagerly.
_call_outside_graph: Callable[..., None] = torch.compiler.disable(_call)  # type: ignore[no-untyped-call]  # unannotated in torch
# Dynamo folds this function to True while tracing, however it is referenced.
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
# Non-strict torch.export runs the hooks eagerly with this flag set; is_compiling() reads the
# same flag (and is_scripting(), which is always False where a Python hook runs).
_export_state: Any = (
    torch.compiler
    if hasattr(torch.compiler, "_is_compiling_flag")
    else types.SimpleNamespace(_is_compiling_flag=False)
)


def _identity(value: Any) -> Any:
    return value


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP/DataParallel (``.module``) or compile (``._orig_mod``).

    Parameter names are taken from the unwrapped module, so module groups read
    ``encoder`` rather than ``module.encoder``.
    """
    wrapper_types: tuple[type, ...] = (torch.nn.DataParallel,)
    if torch.distributed.is_available():
        from torch.nn.parallel import DistributedDataParallel

        wrapper_types = (*wrapper_types, DistributedDataParallel)
    for _ in range(8):  # wrappers nest (compile of DDP); never loop on a self-reference
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            inner = model.module if isinstance(model, wrapper_types) else None
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model


class HookSet:
    """The hooks of one Monitor on one model, optimizer and (optionally) GradScaler."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: object | None = None,
    ) -> None:
        for target, what in ((model, "model"), (optimizer, "optimizer")):
            owner = _ATTACHED.get(target)
            if owner is not None and owner() is not None:  # type: ignore[operator]
                raise AlreadyAttachedError(
                    f"a Monitor is already attached to this {what}; call detach() on it first"
                )
        self._model = model
        self._optimizer = optimizer
        self._scaler = scaler
        self._handles: list[RemovableHandle] = []
        self._scaler_update: Any = None
        self._token = _Token()
        _ATTACHED[model] = weakref.ref(self._token)
        _ATTACHED[optimizer] = weakref.ref(self._token)

    def install(
        self,
        *,
        forward_pre: Callable[[torch.nn.Module, Any, Any], None],
        forward_post: Callable[[torch.nn.Module, Any, Any], None],
        step_pre: Callable[[torch.optim.Optimizer, Any, Any], None],
        step_post: Callable[[torch.optim.Optimizer, Any, Any], None],
        scaler_update: Callable[[], None] | None = None,
    ) -> None:
        """Register every hook; the callbacks are held weakly (bound methods of the Monitor)."""
        self._handles.append(
            self._model.register_forward_pre_hook(_WeakHook(forward_pre), with_kwargs=True)
        )
        self._handles.append(self._model.register_forward_hook(_WeakHook(forward_post)))
        for register, hook in (
            (self._optimizer.register_step_pre_hook, step_pre),
            (self._optimizer.register_step_post_hook, step_post),
        ):
            self._handles.append(register(_WeakHook(hook, outside_graph=True)))
        if self._scaler is not None and scaler_update is not None:
            self._scaler_update = self._scaler.__dict__.get("update", _MISSING)
            original = getattr(self._scaler, "update")  # noqa: B009 - the bound method, wrapped
            self._scaler.__dict__["update"] = _WrappedUpdate(original, scaler_update)

    def remove(self) -> None:
        """Remove every hook and release the model and optimizer for another Monitor."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._scaler is not None and self._scaler_update is not None:
            if self._scaler_update is _MISSING:
                self._scaler.__dict__.pop("update", None)
            else:
                self._scaler.__dict__["update"] = self._scaler_update
            self._scaler_update = None
        for target in (self._model, self._optimizer):
            owner = _ATTACHED.get(target)
            if owner is not None and owner() is self._token:  # type: ignore[operator]
                del _ATTACHED[target]


class _Token:
    """Identity of one HookSet in the attached-objects map (held weakly)."""


_MISSING = object()
