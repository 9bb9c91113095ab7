"""Anomalies, epoch summaries and step samples as JSON lines, kept while Prometheus is down.

Each record is one ``os.write`` of a whole line to a file opened with
``O_APPEND``: a process killed at any moment leaves complete lines (at worst a
last line cut short, which readers skip). A write that fails part-way (a full
disk) is cut back, or the next record starts a new line, so one lost record
never corrupts the next (:func:`stabmon.shared.safefs.append_all`). The file is opened
without following symlinks, in a run subdirectory that must be ours: on a
shared node another user may have pre-created either (:mod:`stabmon.shared.safefs`).
Non-finite floats are written as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` so every line is strict JSON. A full or read-only disk is contained:
counted, logged once, training goes on.

A log whose file disappears (the run directory deleted by a cleanup job while the run
trains) would swallow every later record into an unlinked file: before each record the
open file's link count is checked (one ``fstat``), and a removed file is replaced by a
new one, the run directory created again if needed, counted in
``stabmon_internal_errors_total{component="event_log"}`` and logged once. A forked
child (a DataLoader worker) writes nothing: the log is its parent's, one writer per file.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stabmon.shared.guard import Guard
from stabmon.shared.rundir import prepare_run_directory
from stabmon.shared.safefs import append_all, open_append

__all__ = ["EventLog", "LogFileRemoved", "to_json_safe"]

_COMPONENT = "event_log"


class LogFileRemoved(OSError):
    """The event log's file was removed while open; a new one was opened (or could not be)."""

    def __str__(self) -> str:
        return str(self.strerror)


class EventLog:
    """Appends one JSON object per line to ``path``; never raises."""

    def __init__(self, path: Path, *, common: Mapping[str, Any], guard: Guard) -> None:
        self.path = path
        self._common = dict(common)
        self._guard = guard
        self._fd: int | None = None
        # The watchdog thread writes too; the lock keeps a write off a closed (reused) fd.
        # Re-entrant: a signal handler that writes (a checkpoint) may run while it is held.
        self._lock = threading.RLock()
        #: The process that opened the log: a forked child does not write to it.
        self._pid = os.getpid()
        with guard.contain(_COMPONENT):
            prepare_run_directory(path.parent)
            self._fd = open_append(path)
        self._opened = self._fd is not None

    @property
    def enabled(self) -> bool:
        """Whether the file could be opened (it stays readable after ``close``)."""
        return self._opened

    def write(self, event: str, **fields: Any) -> None:
        """Append ``{"time", "event", <common fields>, <fields>}`` as one line."""
        if self._fd is None:
            return
        with self._guard.contain(_COMPONENT):
            record = {"time": round(time.time(), 6), "event": event, **self._common, **fields}
            line = (json.dumps(to_json_safe(record), separators=(",", ":")) + "\n").encode()
            with self._lock:
                if self._fd is not None and os.getpid() == self._pid:
                    self._reopen_if_removed()
                    append_all(self._fd, line)

    def _reopen_if_removed(self) -> None:
        """Replace a file removed under us with a new one (counted, logged once)."""
        assert self._fd is not None
        if os.fstat(self._fd).st_nlink > 0:
            return
        try:
            prepare_run_directory(self.path.parent)
            fd = open_append(self.path)
        except OSError as error:  # an unsafe root, or no space: this record goes nowhere
            raise LogFileRemoved(
                0,
                f"the event log {self.path} was removed while the run trained and could "
                f"not be opened again ({error}); records are lost until it can",
            ) from None
        os.close(self._fd)
        self._fd = fd
        self._guard.record(
            _COMPONENT,
            LogFileRemoved(
                0,
                f"the event log {self.path} was removed while the run trained (a cleanup "
                "job?); records go to a new file of that name from now on, earlier ones are "
                "gone. Keep run directories of running jobs",
            ),
        )

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            with self._guard.contain(_COMPONENT):
                os.close(fd)


def to_json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as strings and unknown objects as ``str``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Mapping):
        return {str(key): to_json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_safe(item) for item in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)
