"""This process's own record in the run directory: written at attach, kept current by the
heartbeat, finished at exit (how the process ended), removed at detach.

Written atomically (:func:`stabmon.shared.rundir.write_atomic`); the layout and the readers
are :mod:`stabmon.shared.rundir`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import NoReturn

from stabmon.shared.rundir import (
    MAX_RECORD_BYTES,
    ProcessRecord,
    prepare_run_directory,
    write_atomic,
)
from stabmon.shared.safefs import read_regular_with_owner
from stabmon.shared.wrapping import Hold, Patch, SharedWrap

__all__ = ["ExitWatch", "Registration"]


class Registration:
    """Keeps one process's record current: written at attach, refreshed, finished, removed.

    ``write`` runs on the monitor's heartbeat thread, ``exited`` at interpreter
    exit and ``remove`` at detach; a lock and a closed flag keep a late
    heartbeat from resurrecting a record that was already removed. The run
    directory's root is created world-writable and sticky (like ``/tmp``), so
    every user of a shared node can register under it.
    """

    def __init__(
        self,
        root: Path,
        path: Path,
        record: ProcessRecord,
        *,
        on_duplicate: Callable[[ProcessRecord], None] | None = None,
    ) -> None:
        self.root = root
        self.path = path
        self._record = record
        self._lock = threading.Lock()
        self._closed = False
        #: Told, before the first write, about a live process that already holds this
        #: run id and rank (two processes would overwrite one record and share one log).
        self._on_duplicate = on_duplicate
        self._checked_duplicate = False

    def write(
        self,
        *,
        last_step_unix: float | None,
        steps: int,
        now: float,
        phase: str | None = None,
        stall_limit_seconds: float | None = None,
    ) -> None:
        """Write the record with the latest heartbeat (creating the directories if needed).

        ``phase`` and ``stall_limit_seconds`` (the watchdog's current limit) let the daemon
        judge a process too frozen to run its own watchdog; None keeps the last ones written.
        """
        with self._lock:
            if self._closed:
                return
            self._record = replace(
                self._record,
                last_step_unix=last_step_unix,
                steps=steps,
                updated_unix=now,
                phase=phase if phase is not None else self._record.phase,
                stall_limit_seconds=(
                    stall_limit_seconds
                    if stall_limit_seconds is not None
                    else self._record.stall_limit_seconds
                ),
            )
            self._write()

    def hang(
        self,
        *,
        state: str | None,
        where: str | None,
        collectives: int,
        now: float,
        flight: tuple[int, int, int] | None = None,
    ) -> None:
        """Write the hang evidence (None: not stalled) at once, for the other ranks' verdict."""
        with self._lock:
            if self._closed:
                return
            self._record = replace(
                self._record,
                hang_state=state,
                hang_where=where,
                collectives=collectives,
                flight=flight,
                updated_unix=now,
            )
            self._write()

    def exited(self, status: str, now: float, *, signal_name: str | None = None) -> None:
        """Record how the process ended ("clean", "exception" or "signal"); the last write.

        Only in the process the record describes: a forked child that exits is not the run.
        """
        with self._lock:
            if self._closed or self._record.pid != os.getpid():
                return
            self._record = replace(
                self._record, exited_unix=now, exit_status=status, exit_signal=signal_name
            )
            self._write()
            self._closed = True

    def remove(self) -> None:
        """Deregister: a detached process is no longer monitored (the daemon drops it)."""
        with self._lock:
            self._closed = True
            # Only our own record: a forked child or a late finalizer must not remove another's.
            if self._record.pid == os.getpid():
                self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        prepare_run_directory(self.path.parent)
        if not self._checked_duplicate:
            self._checked_duplicate = True
            other = _live_holder(self.path, self._record)
            if other is not None and self._on_duplicate is not None:
                self._on_duplicate(other)
        write_atomic(self.path, self._record.to_json())


def _live_holder(path: Path, mine: ProcessRecord) -> ProcessRecord | None:
    """The record at ``path`` when it names another process that is still running."""
    try:
        data = json.loads(read_regular_with_owner(path, MAX_RECORD_BYTES)[0])
        other = ProcessRecord.from_mapping(data) if isinstance(data, dict) else None
    except (OSError, ValueError, RecursionError):
        return None
    if other is None or other.pid == mine.pid or other.exited_unix is not None:
        return None
    if other.boot_id and mine.boot_id and other.boot_id != mine.boot_id:
        return None
    try:
        os.kill(other.pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's live process
    return other


class ExitWatch:
    """Tells a clean interpreter exit from one caused by an uncaught exception or a failed
    ``sys.exit()``.

    Python calls ``sys.excepthook`` for an uncaught exception before it runs
    ``atexit`` handlers, so a chained hook that notes it is all it takes. ``SystemExit``
    never reaches that hook and no API gives ``atexit`` the exit code, so ``sys.exit`` is
    wrapped too: a call from the main thread with a failure status (a non-zero code, a
    message) is noted, the last call winning. ``raise SystemExit(1)`` written out is not
    seen. Both hooks are process-wide by nature and only observe: installed by the first
    attached Monitor's :meth:`install`, restored when the last releases its hold
    (:class:`stabmon.shared.wrapping.SharedWrap`).
    """

    _uncaught = False
    _interrupted = False
    _failed_exit = False

    @classmethod
    def install(cls) -> Hold[object]:
        """Observe exits until the returned hold is released (at detach)."""
        return _EXIT_WRAP.attach(object())

    @classmethod
    def _patches(cls, wrap: SharedWrap[object]) -> list[Patch]:
        previous = sys.excepthook

        def note_uncaught(
            kind: type[BaseException], error: BaseException, trace: TracebackType | None
        ) -> None:
            cls._uncaught = True  # sys.exit() never gets here; Ctrl-C does, and is no clean end
            # SIGINT's default handler raises KeyboardInterrupt: a person or a scheduler
            # stopped the run, which is not a crash.
            cls._interrupted = issubclass(kind, KeyboardInterrupt)
            previous(kind, error, trace)

        previous_exit = sys.exit

        def note_exit(status: object = None) -> NoReturn:
            if threading.current_thread() is threading.main_thread():
                cls._failed_exit = status is not None and status != 0  # 1, "message", True
            previous_exit(status)  # type: ignore[arg-type]  # whatever it was given, as before

        return [Patch(sys, "excepthook", note_uncaught), Patch(sys, "exit", note_exit)]

    @classmethod
    def status(cls) -> str:
        if cls._interrupted:
            return "signal"
        return "exception" if cls._uncaught or cls._failed_exit else "clean"

    @classmethod
    def signal_name(cls) -> str | None:
        """The signal that ended the process, where it was seen (SIGINT); else None."""
        return "SIGINT" if cls._interrupted else None


_EXIT_WRAP: SharedWrap[object] = SharedWrap(ExitWatch._patches)
