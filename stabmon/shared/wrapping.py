"""Process-wide wrappers held while any Monitor is attached: installed once, restored by the last.

Some things stabmon must see have no hook, only a process-wide name to wrap:
``torch.nn.utils``' clipping functions (:mod:`stabmon.probes.clipping`), the collectives
of ``torch.distributed`` (:mod:`stabmon.probes.collectives`), ``sys.excepthook`` and
``sys.exit`` (:class:`stabmon.shared.rundir.ExitWatch`). Each uses one :class:`SharedWrap`::

    wrap = SharedWrap(lambda wrap: [Patch(module, "barrier", counting(wrap, module.barrier))])
    hold = wrap.attach(counter)   # at attach: installs on the first user
    wrap.users                    # the wrapper dispatches to these (a tuple, no lock)
    hold.release()                # at detach: restores on the last, idempotent

Design
------
One wrapper per name for the whole process, dispatching to the attached users, rather
than one wrapper per Monitor: a per-Monitor wrapper that another Monitor wrapped in turn
cannot be taken out of the chain when its Monitor detaches first. ``users`` is a tuple
replaced under the lock on every attach and release, so the wrapper reads it without
one. A name somebody else wrapped over ours is left as they set it (their wrapper calls
ours, which then calls the original without users). That left-behind wrapper still
dispatches to ``users``, so after the next first attach installs a new one over theirs,
one call passes through two of ours: wrappers must share one re-entrancy guard across
all the generations a SharedWrap installs, and act only in the outermost. This module
imports nothing from stabmon and nothing heavy: it is a leaf.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

__all__ = ["Hold", "Patch", "SharedWrap"]

U = TypeVar("U")


class Patch(NamedTuple):
    """Set ``namespace.name`` to ``wrapper`` (a module, a class or any object)."""

    namespace: Any
    name: str
    wrapper: Any


class Hold(Generic[U]):
    """One user's hold on a :class:`SharedWrap`; :meth:`release` ends it (idempotent)."""

    def __init__(self, wrap: SharedWrap[U], user: U) -> None:
        self._wrap: SharedWrap[U] | None = wrap
        self._user = user

    def release(self) -> None:
        wrap, self._wrap = self._wrap, None
        if wrap is not None:
            wrap._release(self._user)

    # The name hooks.HookSet.keep() calls on what it holds.
    remove = release


class SharedWrap(Generic[U]):
    """Installs ``install(wrap)``'s patches for the first user; undoes them after the last.

    ``install`` runs under the lock, once per first user; it returns the patches to apply
    (it may read the current values, which are the originals to call), whose wrappers
    dispatch to ``wrap.users``.
    """

    def __init__(self, install: Callable[[SharedWrap[U]], Sequence[Patch]]) -> None:
        self._install = install
        self._lock = threading.Lock()
        #: The attached users, in attach order: what the wrappers dispatch to.
        self.users: tuple[U, ...] = ()
        #: (namespace, name, original, wrapper) of each installed patch.
        self._installed: list[tuple[Any, str, Any, Any]] = []

    @property
    def installed(self) -> bool:
        return bool(self._installed)

    def attach(self, user: U) -> Hold[U]:
        with self._lock:
            if not self.users:
                self._apply(self._install(self))
            self.users = (*self.users, user)
        return Hold(self, user)

    def _release(self, user: U) -> None:
        with self._lock:
            users = list(self.users)
            for index, held in enumerate(users):
                if held is user:
                    del users[index]
                    break
            self.users = tuple(users)
            if not users:
                self._restore()

    def _apply(self, patches: Sequence[Patch]) -> None:
        for namespace, name, wrapper in patches:
            original = _own_attribute(namespace, name)
            setattr(namespace, name, wrapper)
            self._installed.append((namespace, name, original, wrapper))

    def _restore(self) -> None:
        for namespace, name, original, wrapper in reversed(self._installed):
            if _own_attribute(namespace, name) is wrapper:  # else somebody wrapped ours: theirs
                setattr(namespace, name, original)
        self._installed = []


def _own_attribute(namespace: Any, name: str) -> Any:
    """The attribute as ``namespace`` itself holds it (a class: not an inherited one)."""
    if isinstance(namespace, type):
        return vars(namespace).get(name)
    return getattr(namespace, name, None)
