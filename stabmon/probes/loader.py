"""Data loader health: a loader that can wait forever, and worker processes that die.

A DataLoader with worker processes and ``timeout=0`` (the default) waits forever
for a batch from a worker that hangs, on a stuck network filesystem read or a
deadlock inherited through fork: the run stalls with nothing in its log. A
worker that is killed (the OOM killer picks the biggest, often a worker whose
memory grew) makes PyTorch raise at the next batch, and the reason is lost with
the process. :func:`loader_problem` catches the first at ``track()``;
:class:`WorkerWatch`, polled from the sampling thread, writes the second into the
event log with the worker's pid and exit status while the process still lives.
"""

from __future__ import annotations

import signal
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["WorkerWatch", "loader_problem"]

#: Dead workers remembered, so each is reported once (workers restart every epoch).
MAX_REPORTED = 256


def loader_problem(loader: object) -> str | None:
    """Why this loader can hang the run for good, or None."""
    workers = getattr(loader, "num_workers", 0)
    timeout = getattr(loader, "timeout", None)
    if not isinstance(workers, int) or workers <= 0 or timeout != 0:
        return None
    return (
        f"the DataLoader has num_workers={workers} and timeout=0: a worker that hangs (a stuck "
        "read on a network filesystem, a deadlock after fork) makes the loop wait forever. "
        "Set DataLoader(timeout=...) to a few minutes so it raises instead; the stall alert "
        "fires either way"
    )


class WorkerWatch:
    """Follows the worker processes of the loader iterator that ``track()`` runs now."""

    def __init__(self, report: Callable[[dict[str, Any]], None]) -> None:
        self._report = report
        self._iterator: weakref.ref[Any] | None = None
        self._reported: set[int] = set()

    def follow(self, iterator: object) -> None:
        """The iterator of the current pass (its workers, if it has any, are watched)."""
        self._iterator = weakref.ref(iterator) if hasattr(iterator, "_workers") else None

    def iterator(self) -> object | None:
        """The loader iterator of the current pass, while it has workers and is alive."""
        return self._iterator() if self._iterator is not None else None

    def check(self) -> None:
        """Report each worker that died while its loader still needed it (sampling thread)."""
        self._check(after_error=False)

    def failed(self, error: BaseException) -> None:
        """The loader raised (PyTorch's "worker exited unexpectedly"): report why, now.

        Called from ``next()``'s failure, before the iterator shuts its workers down
        and the exit status is lost with it.
        """
        self._check(after_error=True)

    def _check(self, *, after_error: bool) -> None:
        iterator = self._iterator() if self._iterator is not None else None
        if iterator is None or (getattr(iterator, "_shutdown", True) and not after_error):
            return
        active = getattr(iterator, "_workers_status", None)
        for index, worker in enumerate(list(getattr(iterator, "_workers", ()))):
            exitcode = worker.exitcode  # polls the child without blocking
            if exitcode is None or worker.pid in self._reported:
                continue
            finished = isinstance(active, list) and index < len(active) and not active[index]
            if exitcode == 0 and finished:
                continue  # told to stop (its share of an IterableDataset was done)
            if len(self._reported) < MAX_REPORTED:
                self._reported.add(worker.pid)
            self._report(
                {"worker": index, "pid": worker.pid, "exitcode": exitcode,
                 "signal": _signal_name(exitcode)}
            )  # fmt: skip


def _signal_name(exitcode: int) -> str | None:
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return None
