"""Stacks of DataLoader worker processes, for a main thread that waits on them.

Design
------
A worker is another process: the stall watchdog's ``sys._current_frames()``
cannot see it. At ``track()`` of a DataLoader with workers,
:meth:`WorkerStacks.install` chains the loader's ``worker_init_fn`` with
:class:`WorkerInit`, which in each new worker:

1. creates ``rank-R.loader-L.worker-W.stacks`` in the run directory through a
   temporary name: opened without following a symlink, checked to be a regular
   file of our own uid, mode 0600, append-only, starting with a header naming the
   worker's pid;
2. registers :func:`faulthandler.register` on :data:`STACKS_SIGNAL` to write every
   thread's stack to it (async-signal-safe, even while the worker blocks in C). A
   handler the worker already had for it (submitit's, say, inherited from the main
   process) is chained: it runs after the dump. The default action is not chained (it
   would end the worker), so a worker without a handler only dumps; a handler the
   user's own ``worker_init_fn`` installs afterwards replaces ours (no stacks then);
3. renames it into place, then runs the user's own ``worker_init_fn``.

A failure is contained: the worker goes on without the registration, and no file
means it is never signalled (the signal's default action would end it). Names
are per loader slot and worker id, so there are at most ``MAX_LOADERS`` x
workers files however many epochs restart the workers; the slot of a loader that
was collected (a loop that builds its DataLoader each epoch) is reused. A second
live Monitor of the same rank in one process (one run directory) names its files
``rank-R.monitor-K.loader-L``, K its index among the live ones.

On a stall in ``data_wait`` (:mod:`stabmon.wiring.stall_action`, watchdog thread),
:meth:`WorkerStacks.capture` takes the live workers of the iterator the loop
waits on, signals only those whose file's header names their pid (a child that
is not reaped cannot have a reused pid), cuts each file back to its header first
and reads at most :data:`MAX_STACK_BYTES` of the dump, waiting at most a second.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stabmon.shared.safefs import open_owned

__all__ = ["STACKS_SIGNAL", "WorkerInit", "WorkerStack", "WorkerStacks", "innermost_frame"]

#: The signal a worker dumps its stacks on. SIGUSR2: unused by PyTorch's workers.
STACKS_SIGNAL = signal.SIGUSR2
#: Loaders per Monitor whose workers dump stacks (a train and a validation loader, ...).
MAX_LOADERS = 8
#: What is read of one worker's dump (faulthandler bounds its own: 100 frames x 100 threads).
MAX_STACK_BYTES = 64 * 1024
_HEADER = "stabmon worker stacks pid={pid}\n"
_FRAME = re.compile(r'File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<function>\S+)')


@dataclass(frozen=True)
class WorkerStack:
    """One worker's stacks as faulthandler wrote them, and its blocking frame."""

    worker: int
    pid: int
    where: str
    stack: str
    #: Waiting for work in PyTorch's worker loop (its index queue), not blocked in a fetch.
    idle: bool = False


class WorkerInit:
    """A DataLoader ``worker_init_fn``: register the stack dump, then call the user's own.

    A plain class, not a closure, so it pickles for the ``spawn`` start method.
    """

    def __init__(self, directory: str, prefix: str, original: Callable[[int], Any] | None) -> None:
        self.directory = directory
        self.prefix = prefix
        self.original = original

    def path(self, worker_id: int) -> Path:
        return Path(self.directory) / f"{self.prefix}.worker-{worker_id}.stacks"

    def __call__(self, worker_id: int) -> None:
        try:
            _register(self.path(worker_id))
        except Exception:  # noqa: BLE001 (never break a worker; no file: never signalled)
            pass
        if self.original is not None:
            self.original(worker_id)


def _register(path: Path) -> None:
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = open_owned(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
    registered = False
    try:
        os.write(fd, _HEADER.format(pid=os.getpid()).encode())
        previous = signal.getsignal(STACKS_SIGNAL)
        # Chain to a handler the worker had (submitit's, say); never to the default action,
        # which would end the worker, nor to SIG_IGN (nothing to call).
        chain = previous not in (signal.SIG_DFL, signal.SIG_IGN)
        faulthandler.register(STACKS_SIGNAL, file=fd, all_threads=True, chain=chain)
        registered = True
        os.rename(temporary, path)  # rename(2) is atomic: the file exists only once registered
    except BaseException:
        if registered:  # else faulthandler would write into whatever file reuses the fd number
            faulthandler.unregister(STACKS_SIGNAL)
        os.close(fd)
        temporary.unlink(missing_ok=True)
        raise
    # fd stays open for the worker's life: faulthandler writes to it at the signal.


class WorkerStacks:
    """Installs :class:`WorkerInit` on tracked loaders; captures live workers' stacks."""

    def __init__(
        self,
        directory: Path,
        *,
        rank: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._directory = directory
        self._rank = rank
        self._clock = clock
        self._sleep = sleep
        #: slot -> (loader, the init installed on it, the loader's own).
        self._installed: dict[int, tuple[weakref.ref[Any], WorkerInit, Any]] = {}
        #: This instance's index among those in this process with loaders installed: two
        #: Monitors of one rank (one run directory) must not share file names. 0 keeps the
        #: plain names. Taken at the first install, given back at uninstall (or collection).
        self._monitor = 0
        self._give_back: weakref.finalize[[int], WorkerStacks] | None = None

    def install(self, loader: object) -> None:
        """Chain ``loader.worker_init_fn`` when it is a loader with worker processes."""
        workers = getattr(loader, "num_workers", 0)
        if not isinstance(workers, int) or workers <= 0 or not hasattr(loader, "worker_init_fn"):
            return
        current = loader.worker_init_fn
        if isinstance(current, WorkerInit):
            return  # tracked again (a new epoch)
        for dead, (reference, _, _) in list(self._installed.items()):
            if reference() is None:  # a loader built per epoch: its slot is free again
                del self._installed[dead]
        free = [n for n in range(MAX_LOADERS) if n not in self._installed]
        if not free:
            return  # enough live loaders
        slot = free[0]
        if self._give_back is None:
            self._monitor = _MONITORS.take()
            self._give_back = weakref.finalize(self, _MONITORS.give_back, self._monitor)
        monitor = f".monitor-{self._monitor}" if self._monitor else ""
        prefix = f"rank-{self._rank}{monitor}.loader-{slot}"
        init = WorkerInit(str(self._directory), prefix, current)
        loader.worker_init_fn = init  # read by each new iterator (epoch) of the loader
        self._installed[slot] = (weakref.ref(loader), init, current)

    def uninstall(self) -> None:
        """Give each loader its own ``worker_init_fn`` back (at detach)."""
        for reference, init, original in self._installed.values():
            loader = reference()
            if loader is not None and getattr(loader, "worker_init_fn", None) is init:
                loader.worker_init_fn = original
        self._installed.clear()
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()  # the index, once (a finalizer runs at most once)

    def capture(self, iterator: object, timeout: float = 1.0) -> list[WorkerStack]:
        """Signal the live workers of ``iterator`` and read their stacks (at most ``timeout``)."""
        init = getattr(iterator, "_worker_init_fn", None)
        if not isinstance(init, WorkerInit):
            return []
        pending: dict[int, tuple[int, Path, int]] = {}  # pid -> (worker, path, header size)
        for worker_id, process in enumerate(list(getattr(iterator, "_workers", ()))):
            pid = getattr(process, "pid", None)
            if not isinstance(pid, int) or process.exitcode is not None:
                continue  # gone (or reaped): its pid may name another process now
            path = init.path(worker_id)
            header = _HEADER.format(pid=pid).encode()
            if not _reset(path, header):
                continue  # not registered (yet), or not this worker's file
            try:
                os.kill(pid, STACKS_SIGNAL)
            except OSError:
                continue  # exited since: nothing to read
            pending[pid] = (worker_id, path, len(header))
        found: list[WorkerStack] = []
        deadline = self._clock() + timeout
        sizes: dict[int, int] = {}
        while pending and self._clock() < deadline:
            self._sleep(0.02)
            for pid, (worker_id, path, header_size) in list(pending.items()):
                text = _read(path, header_size)
                if text is None or not text.strip():
                    continue
                if sizes.get(pid) != len(text):  # still being written: read it again
                    sizes[pid] = len(text)
                    continue
                del pending[pid]
                where, file = _innermost(text)
                found.append(WorkerStack(worker_id, pid, where, text, idle=_idle(file)))
        return sorted(found, key=lambda stack: stack.worker)


class _Indices:
    """The lowest free small integers, taken and given back under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: set[int] = set()

    def take(self) -> int:
        with self._lock:
            index = next(n for n in range(len(self._taken) + 1) if n not in self._taken)
            self._taken.add(index)
            return index

    def give_back(self, index: int) -> None:
        with self._lock:
            self._taken.discard(index)


_MONITORS = _Indices()


def _reset(path: Path, header: bytes) -> bool:
    """Cut the file back to its header when it is this worker's; whether it is."""
    try:
        fd = open_owned(path, os.O_RDWR)
    except OSError:
        return False
    try:
        if os.pread(fd, len(header), 0) != header:
            return False
        os.ftruncate(fd, len(header))
        return True
    finally:
        os.close(fd)


def _read(path: Path, offset: int) -> str | None:
    try:
        fd = open_owned(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.pread(fd, MAX_STACK_BYTES, offset).decode("utf-8", "replace")
    finally:
        os.close(fd)


def innermost_frame(dump: str) -> str:
    """``data.py:42 in __getitem__``: the innermost frame of the worker loop's thread.

    faulthandler writes each thread most recent call first; the thread running
    PyTorch's worker loop is the one that fetches, else the first thread is taken.
    """
    return _innermost(dump)[0]


def _idle(file: str) -> bool:
    return any(part in file for part in ("/multiprocessing/", "/_utils/worker.py", "/queue.py"))


def _innermost(dump: str) -> tuple[str, str]:
    blocks = [block for block in re.split(r"\n(?=(?:Current thread|Thread) )", dump) if block]
    chosen = next((block for block in blocks if "/torch/utils/data/_utils/worker.py" in block),
                  blocks[0] if blocks else "")  # fmt: skip
    match = _FRAME.search(chosen)
    if match is None:
        return "", ""
    file = match["file"].replace("\\", "/")
    return f"{file.rsplit('/', 1)[-1]}:{match['line']} in {match['function']}", file
