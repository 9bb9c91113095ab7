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

Hooks hold their owner (the Monitor's :class:`~stabmon.wiring.step_hooks.StepHooks`, which
holds the hook bodies) weakly and are inert when copied or pickled: EMA and SWA
code deep-copies the model mid-run (``AveragedModel``), and ``torch.save(model)``
pickles its hooks; neither may drag the Monitor, its threads and locks along.
Better still, they are not pickled at all: when the model's hook dicts are empty at
attach (the usual case), they are replaced by :class:`_HookDict`, an ``OrderedDict``
that pickles (and deep-copies) as a plain ``OrderedDict`` without stabmon's entries.
So ``torch.save(model)`` while attached writes no stabmon global, and the file loads
in a process that never imported stabmon, with ``weights_only=True`` too. (Dicts
that already hold hooks are left alone: their handles point at them.)

Which objects carry a Monitor is process-wide truth (hooks are process-wide
too), so it is kept in a module-level weak mapping: attaching a second Monitor
to the same model or optimizer is refused while the first is alive.
"""

from __future__ import annotations

import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from stabmon.errors import AlreadyAttachedError
from stabmon.probes.unwrap import unwrap_model

__all__ = ["HookSet", "unwrap_model", "watch_gradient"]

_ATTACHED: weakref.WeakKeyDictionary[object, object] = weakref.WeakKeyDictionary()


#: A hook method of the owner, bound: (module or optimizer, args, kwargs or output).
_Method = Callable[[Any, Any, Any], None]


class _Hooks:
    """What torch holds as stabmon's hooks: bound methods of this object.

    It holds the owner weakly and calls its hook methods. Torch calls a bound
    method through vectorcall with the three arguments as they are; an object with
    ``__call__(*args, **kwargs)`` built a tuple and a dict per call, four calls a step
    (``bench/instructions.py stabmon_hooks_only`` counts what the hooks cost).

    A copy or an unpickled model gets an inert instance (its owner is gone), so
    ``AveragedModel``'s deep copy and ``torch.save(model)`` drag nothing along.
    """

    __slots__ = ("_forward_post", "_forward_pre", "_owner", "_scaler_update", "_step_post",
                 "_step_pre")  # fmt: skip

    def __init__(
        self,
        *,
        forward_pre: _Method,
        forward_post: _Method,
        step_pre: _Method,
        step_post: _Method,
        scaler_update: Callable[[], None] | None,
    ) -> None:
        owner = forward_pre.__self__  # type: ignore[attr-defined]  # a bound method
        self._owner: Callable[[], Any] = weakref.ref(owner)
        # The plain functions, called with the owner: a WeakMethod would build a bound method
        # at every call.
        self._forward_pre = _function_of(forward_pre, owner)
        self._forward_post = _function_of(forward_post, owner)
        self._step_pre = _function_of(step_pre, owner)
        self._step_post = _function_of(step_post, owner)
        self._scaler_update = None if scaler_update is None else _function_of(scaler_update, owner)

    @classmethod
    def inert(cls) -> _Hooks:
        """Hooks whose owner is gone: every call does nothing."""
        hooks = cls.__new__(cls)
        hooks._owner = _gone
        return hooks

    # The four hooks are written out rather than sharing a helper: a helper would be one more
    # Python call per hook, four a step.
    # Under torch.compile a forward hook is a constant no-op in traced code (no graph break).
    # torch.compiler.is_compiling() is inlined: one Python call fewer per hook.

    def forward_pre(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if _is_dynamo_compiling() or _export_state._is_compiling_flag:
            return
        owner = self._owner()
        if owner is not None:
            self._forward_pre(owner, module, args, kwargs)

    def forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if _is_dynamo_compiling() or _export_state._is_compiling_flag:
            return
        owner = self._owner()
        if owner is not None:
            self._forward_post(owner, module, args, output)

    # The optimizer's step hooks run outside the graph: a step stabmon did not see would be a
    # lost measurement and a false stall.

    def step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _is_dynamo_compiling() or _export_state._is_compiling_flag:
            _call_outside_graph(self._owner, self._step_pre, optimizer, args, kwargs)
            return
        owner = self._owner()
        if owner is not None:
            self._step_pre(owner, optimizer, args, kwargs)

    def step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _is_dynamo_compiling() or _export_state._is_compiling_flag:
            _call_outside_graph(self._owner, self._step_post, optimizer, args, kwargs)
            return
        owner = self._owner()
        if owner is not None:
            self._step_post(owner, optimizer, args, kwargs)

    def scaler_update(self) -> None:
        owner = self._owner()
        if owner is not None and self._scaler_update is not None:
            self._scaler_update(owner)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hooks:
        return _Hooks.inert()

    def __reduce__(self) -> tuple[Callable[[], _Hooks], tuple[()]]:
        return (_inert_hooks, ())


class _HookDict(OrderedDict[int, Any]):
    """A module's hook dict whose stabmon entries are left out of pickles and copies."""

    def __init__(self) -> None:
        super().__init__()
        self.ours: set[int] = set()

    def __reduce__(self) -> tuple[Any, ...]:
        # The plain class, so the pickle names collections.OrderedDict and nothing of ours.
        items: Iterator[tuple[int, Any]] = (
            (key, hook) for key, hook in list(self.items()) if key not in self.ours
        )
        return (OrderedDict, (), None, None, items)


#: The hook dicts of a module that stabmon's root-module hooks write to.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks")


def _function_of(method: Callable[..., None], owner: object) -> Callable[..., None]:
    if getattr(method, "__self__", None) is not owner:
        raise TypeError("every hook must be a bound method of the same object")
    return method.__func__  # type: ignore[attr-defined, no-any-return]  # a bound method


def _gone() -> None:
    """The weak reference of inert hooks: always dead."""
    return None


def _inert_hooks() -> _Hooks:
    return _Hooks.inert()


class _WrappedUpdate:
    """``GradScaler.update`` followed by a callback; copies and pickles get the plain method."""

    def __init__(self, original: Callable[..., None], after: Callable[[], None]) -> None:
        self._original = original  # the class's update, bound to the scaler
        self._after = after  # _Hooks.scaler_update: holds the owner weakly

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
    target: Callable[[], Any],
    function: Callable[..., None],
    optimizer: torch.optim.Optimizer,
    args: Any,
    kwargs: Any,
) -> None:
    owner = target()
    if owner is not None:
        function(owner, optimizer, args, kwargs)


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
        self._handles: list[RemovableHandle | Any] = []
        #: The optimizer's two step hooks, moved by bind_optimizer().
        self._step_handles: list[RemovableHandle] = []
        self._hooks: _Hooks | None = None
        self._scaler_update: Any = None
        self._swapped: tuple[str, ...] = ()
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
        """Register every hook: bound methods of one object (the owner), held weakly."""
        hooks = _Hooks(
            forward_pre=forward_pre,
            forward_post=forward_post,
            step_pre=step_pre,
            step_post=step_post,
            scaler_update=scaler_update if self._scaler is not None else None,
        )
        self._swapped = _own_hook_dicts(self._model)
        pre = self._model.register_forward_pre_hook(hooks.forward_pre, with_kwargs=True)
        post = self._model.register_forward_hook(hooks.forward_post)
        for name in self._swapped:
            getattr(self._model, name).ours.update((pre.id, post.id))
        self._handles += [pre, post]
        self._hooks = hooks
        self._step_handles = [
            self._optimizer.register_step_pre_hook(hooks.step_pre),
            self._optimizer.register_step_post_hook(hooks.step_post),
        ]
        self._handles += self._step_handles
        if self._scaler is not None and scaler_update is not None:
            self._scaler_update = self._scaler.__dict__.get("update", _MISSING)
            original = getattr(self._scaler, "update")  # noqa: B009 - the bound method, wrapped
            self._scaler.__dict__["update"] = _WrappedUpdate(original, hooks.scaler_update)

    def watch_modules(
        self, hook: Callable[[str, Any, Any], None], names: Collection[str] | None = None
    ) -> Callable[[], None]:
        """A forward hook on every module of the (unwrapped) model, or on those ``names``
        (``""``: the root), ``hook(name, inputs, output)``, until the returned callable
        removes them (or ``remove()`` does).

        For a plug-in armed for a few steps (NaN provenance): held weakly, inert and left
        out when a model is copied or pickled meanwhile, as the root-module hooks are.
        """
        handles: list[RemovableHandle] = []
        swapped: list[tuple[torch.nn.Module, tuple[str, ...]]] = []
        target = _WeakHook(hook)
        for name, module in unwrap_model(self._model).named_modules():
            if names is not None and name not in names:
                continue
            owned = _own_hook_dicts(module, ("_forward_hooks",))
            handle = module.register_forward_hook(_ModuleWatch(name, target))
            if owned:
                module._forward_hooks.ours.add(handle.id)
                swapped.append((module, owned))
            handles.append(handle)

        def unwatch() -> None:
            for handle in handles:
                handle.remove()
            handles.clear()
            for module, names in swapped:
                _restore_hook_dicts(module, names)
            swapped.clear()
            self._forget(removal)

        removal = _Removal(unwatch)
        self._handles.append(removal)
        return unwatch

    def watch_output(self, hook: Callable[[Any, Any], None]) -> Callable[[], None]:
        """A forward hook on the root model, ``hook(kwargs, output)``, until the returned
        callable removes it (or ``remove()`` does).

        For an adapter that reads the loss a trainer's model returns (Hugging Face: the
        Trainer filters NaN losses out of what it logs): held weakly, inert and left out
        when the model is copied or pickled, as the other root-module hooks are.
        """
        owned = _own_hook_dicts(self._model, ("_forward_hooks",))
        handle = self._model.register_forward_hook(_OutputWatch(_WeakHook(hook)), with_kwargs=True)
        hook_dict = vars(self._model).get("_forward_hooks")
        if isinstance(hook_dict, _HookDict):  # ours now, or since install()
            hook_dict.ours.add(handle.id)

        def unwatch() -> None:
            handle.remove()
            _restore_hook_dicts(self._model, owned)
            self._forget(removal)

        removal = _Removal(unwatch)
        self._handles.append(removal)
        return unwatch

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Move the step hooks to ``optimizer`` (from the stand-in a Monitor attached to a
        model alone holds until its optimizer exists: ``Monitor.bind_optimizer``)."""
        owner = _ATTACHED.get(optimizer)
        if owner is not None and owner() not in (None, self._token):  # type: ignore[operator]
            raise AlreadyAttachedError(
                "a Monitor is already attached to this optimizer; call detach() on it first"
            )
        hooks = self._hooks
        if hooks is None:
            raise RuntimeError("bind_optimizer() before install()")
        for handle in self._step_handles:
            handle.remove()
            self._handles.remove(handle)
        previous, self._optimizer = self._optimizer, optimizer
        if _ATTACHED.get(previous) is not None:
            del _ATTACHED[previous]
        _ATTACHED[optimizer] = weakref.ref(self._token)
        self._step_handles = [
            optimizer.register_step_pre_hook(hooks.step_pre),
            optimizer.register_step_post_hook(hooks.step_post),
        ]
        self._handles += self._step_handles

    def watch_optimizers(self, hook: Callable[[torch.optim.Optimizer], None]) -> _StepWatch:
        """``hook(optimizer)`` before every ``step()`` of any optimizer in the process (torch's
        global step pre-hook), held weakly, until ``remove()``.

        The watch cannot be removed while torch runs the global hooks (it iterates their
        dict): inside ``hook``, call :meth:`_StepWatch.disarm` (the call is then one
        attribute test a step) and leave the removal to ``remove()``.
        """
        watch = _StepWatch(_WeakHook(hook))
        watch.handle = register_optimizer_step_pre_hook(watch)
        self._handles.append(watch)
        return watch

    def keep(self, handle: Any) -> None:
        """Remove ``handle`` (anything with ``remove()``, e.g. a clip watch) with the hooks."""
        self._handles.append(handle)

    def _forget(self, removal: _Removal) -> None:
        """A watch ended: its removal leaves the handles (a watch armed once per NaN episode
        over a long run would otherwise keep one each)."""
        if removal in self._handles:
            self._handles.remove(removal)

    def remove(self) -> None:
        """Remove every hook and release the model and optimizer for another Monitor."""
        handles, self._handles = self._handles, []  # a watch's removal forgets itself
        for handle in handles:
            handle.remove()
        _restore_hook_dicts(self._model, getattr(self, "_swapped", ()))
        self._swapped = ()
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


def watch_gradient(tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """``hook(gradient)`` when autograd computes ``tensor``'s gradient (the total over its
    uses), for NaN provenance's armed steps: registered from a module watch, on a tensor of
    this step's graph, so it goes with the graph and there is nothing to remove. ``hook``
    returns None (the gradient passes unchanged) and must neither raise nor sync.

    A leaf (a parameter passed as a module's input, DETR's query embeddings) is left
    unwatched: its hook would stay on it for good, one more each watched step, fire after
    the watch, and make pickling the model warn; its gradient is the parameter's own,
    which the gradient norms judge."""
    if tensor.grad_fn is None:
        return
    tensor.register_hook(hook)  # type: ignore[no-untyped-call]  # unannotated in torch


def _own_hook_dicts(
    model: torch.nn.Module, names: tuple[str, ...] = _HOOK_DICTS
) -> tuple[str, ...]:
    """Replace the model's empty hook dicts by :class:`_HookDict`; the names replaced."""
    swapped = []
    for name in names:
        hook_dict = vars(model).get(name)
        if type(hook_dict) is OrderedDict and not hook_dict:
            object.__setattr__(model, name, _HookDict())
            swapped.append(name)
    return tuple(swapped)


def _restore_hook_dicts(model: torch.nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        hook_dict = vars(model).get(name)
        if isinstance(hook_dict, _HookDict) and not hook_dict:
            # Empty again: the plain dict back (a user's hook added meanwhile keeps ours,
            # which its handle points at; it pickles as a plain dict all the same).
            object.__setattr__(model, name, OrderedDict())


class _WeakHook:
    """A plug-in's module hook, held weakly: a dropped Monitor's plug-in is not kept alive."""

    __slots__ = ("_ref",)

    def __init__(self, hook: Callable[..., None]) -> None:
        self._ref: Any = weakref.WeakMethod(hook) if hasattr(hook, "__self__") else (lambda: hook)

    def __call__(self, *args: Any) -> None:
        hook = self._ref()
        if hook is not None:
            hook(*args)


class _ModuleWatch:
    """One module's forward hook for :meth:`HookSet.watch_modules`; inert when copied."""

    __slots__ = ("_name", "_target")

    def __init__(self, name: str, target: _WeakHook | None) -> None:
        self._name, self._target = name, target

    def __call__(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        # Traced code (torch.compile, export): a constant no-op, so no graph break and no
        # side effect in the graph; a compiled forward is not watched.
        if _is_dynamo_compiling() or _export_state._is_compiling_flag:
            return
        if self._target is not None:
            self._target(self._name, inputs, output)

    def __deepcopy__(self, memo: dict[int, Any]) -> _ModuleWatch:
        return _ModuleWatch(self._name, None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ModuleWatch, (self._name, None))


class _OutputWatch:
    """The root module's output hook for :meth:`HookSet.watch_output`; inert when copied."""

    __slots__ = ("_target",)

    def __init__(self, target: _WeakHook | None) -> None:
        self._target = target

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if _is_dynamo_compiling() or _export_state._is_compiling_flag:
            return  # a constant no-op in traced code, as the other forward hooks
        if self._target is not None:
            self._target(kwargs, output)

    def __deepcopy__(self, memo: dict[int, Any]) -> _OutputWatch:
        return _OutputWatch(None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_OutputWatch, (None,))


class _StepWatch:
    """A global optimizer step pre-hook for :meth:`HookSet.watch_optimizers`."""

    __slots__ = ("_target", "handle")

    def __init__(self, target: _WeakHook | None) -> None:
        self._target = target
        self.handle: RemovableHandle | None = None

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._target is not None and not _is_dynamo_compiling():
            self._target(optimizer)

    def disarm(self) -> None:
        """Call nothing any more; safe inside the hook, where ``remove()`` is not."""
        self._target = None

    def remove(self) -> None:
        self._target = None
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.remove()


class _Removal:
    """A removal callable kept with the handles, so ``remove()`` also ends a watch."""

    __slots__ = ("_remove",)

    def __init__(self, remove: Callable[[], None]) -> None:
        self._remove = remove

    def remove(self) -> None:
        self._remove()


class _Token:
    """Identity of one HookSet in the attached-objects map (held weakly)."""


_MISSING = object()
