"""Counts the collectives a process issues, without a sync: hang evidence for every rank.

Design
------
At attach, the collective functions of ``torch.distributed`` (and of
``torch.distributed.distributed_c10d``, whose functions call each other through
module globals) are replaced by thin wrappers that add one to a counter and
note the call's name while it runs: two attribute stores per call, nothing on
the device. The training thread writes, the watchdog and exporter only read.
Nested calls (``all_gather_object`` calls ``all_gather``) count once.

The replacement is process-wide by nature: one wrapper per function
(:class:`stabmon.shared.wrapping.SharedWrap`) counts for every attached counter, installed
by the first ``install`` and restored by the last ``uninstall``, so two monitors in
one process unwind in any order. DDP's gradient all-reduces are issued from C++ and are not
counted: the loop phase (``backward``) covers them; nor are calls inside a
``torch.compile``d region, which dynamo traces as if unwrapped (no graph break
is added). NCCL's flight recorder
(``TORCH_NCCL_TRACE_BUFFER_SIZE``) keeps its own sequence numbers; it does not
exist for gloo, so it is not read here.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from stabmon.shared.wrapping import Hold, Patch, SharedWrap

__all__ = ["COLLECTIVE_FUNCTIONS", "CollectiveCounter"]

#: torch.distributed functions that synchronise ranks; the names are stable public API.
COLLECTIVE_FUNCTIONS: tuple[str, ...] = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv",
)  # fmt: skip


class CollectiveCounter:
    """Collectives issued by this process, and the one the training thread is in now.

    >>> counter = CollectiveCounter()
    >>> counter.install()          # at attach
    >>> counter.issued, counter.current
    (0, None)
    """

    def __init__(self, modules: tuple[ModuleType, ...] | None = None) -> None:
        #: Collectives issued so far (outermost calls only).
        self.issued = 0
        #: Name of the collective the main thread is inside now, else None.
        self.current: str | None = None
        self._modules = modules
        self._hold: Hold[CollectiveCounter] | None = None

    def install(self) -> None:
        """Count the collective functions of ``torch.distributed`` (where it is available)."""
        if self._hold is None:
            modules = self._modules if self._modules is not None else _distributed_modules()
            self._hold = _shared_wrap(modules).attach(self)

    def uninstall(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()


#: One shared wrap per tuple of modules (torch.distributed's, or a test's stand-in).
_WRAPS: dict[tuple[ModuleType, ...], SharedWrap[CollectiveCounter]] = {}
_WRAPS_LOCK = threading.Lock()


def _shared_wrap(modules: tuple[ModuleType, ...]) -> SharedWrap[CollectiveCounter]:
    with _WRAPS_LOCK:
        wrap = _WRAPS.get(modules)
        if wrap is None:
            # One _Inside for every generation of wrappers: a wrapper left inside somebody
            # else's chain at the last detach is still called after the next attach puts a
            # new one over theirs, and the two must count the call once.
            install = functools.partial(_patches, modules, _Inside())
            wrap = _WRAPS[modules] = SharedWrap(install)
        return wrap


def _patches(
    modules: tuple[ModuleType, ...], inside: _Inside, wrap: SharedWrap[CollectiveCounter]
) -> list[Patch]:
    patches: list[Patch] = []
    wrappers: dict[int, Callable[..., Any]] = {}
    for module in modules:
        for name in COLLECTIVE_FUNCTIONS:
            original = getattr(module, name, None)
            if original is None or not callable(original):
                continue
            wrapper = wrappers.get(id(original))
            if wrapper is None:
                wrapper = wrappers[id(original)] = _wrap(name, original, wrap, inside)
            patches.append(Patch(module, name, wrapper))
    return patches


class _Inside:
    """Whether the main thread is inside a counted collective (nested calls count once).

    One per :class:`SharedWrap`, shared by all the wrappers it ever installed.
    """

    def __init__(self) -> None:
        self.now = False


def _wrap(
    name: str,
    original: Callable[..., Any],
    wrap: SharedWrap[CollectiveCounter],
    inside: _Inside,
) -> Callable[..., Any]:
    main = threading.main_thread().ident
    compiling = _is_compiling()

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if compiling():  # dynamo traces the original, as if unwrapped: no graph break
            return original(*args, **kwargs)
        counters = wrap.users
        if not counters or threading.get_ident() != main or inside.now:
            return original(*args, **kwargs)  # another thread's, or nested: counted once
        inside.now = True
        for counter in counters:
            counter.issued += 1
            counter.current = name
        try:
            return original(*args, **kwargs)
        finally:
            inside.now = False
            for counter in counters:
                counter.current = None

    return counted


def _is_compiling() -> Callable[[], bool]:
    try:
        import torch.compiler
    except ImportError:
        return lambda: False
    return torch.compiler.is_compiling


def _distributed_modules() -> tuple[ModuleType, ...]:
    try:
        import torch.distributed as distributed
        from torch.distributed import distributed_c10d
    except ImportError:  # a torch built without distributed support
        return ()
    if not distributed.is_available():
        return ()
    return (distributed, distributed_c10d)
