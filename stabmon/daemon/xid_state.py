"""XID counts and last-event times that survive a daemon restart.

Design
------
A restarted daemon that starts its XID counters from zero makes Prometheus see
a reset: an alert already firing resolves, and a new event is hidden behind
the counts from before the restart. :class:`XidState` keeps, per (GPU UUID,
xid), the count, the GPU's index and the Unix time of the last event in one
small JSON file, rewritten atomically (write, then rename) at each event, which
is rare. The XID thread is the only writer; the scrape thread reads copies
under a lock.

The file lives in a directory the daemon creates for itself (mode 0700). The
default is inside the run directory, which every user of the node may write:
a directory or file there that is not the daemon's own (another owner, a
symlink, not a regular file) is refused with one log line, and the counts then
live in memory only, as before. A corrupt file is ignored the same way.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from stabmon.contract import GPU_XID_LAST_EVENT
from stabmon.export.families import family
from stabmon.shared.log import LogLimiter
from stabmon.shared.rundir import write_atomic

__all__ = ["XidEntry", "XidState", "XidStateCollector", "state_path"]

#: More distinct (GPU, xid) pairs than any node has; bounds the file and the series.
MAX_ENTRIES = 1024
_MAX_FILE_BYTES = 256 * 1024
_STATE_DIRECTORY = ".stabmon-daemon"


def state_path(run_dir: Path) -> Path:
    """Where the daemon keeps its XID state by default."""
    return run_dir / _STATE_DIRECTORY / "xid.json"


@dataclass(frozen=True)
class XidEntry:
    """One (GPU, xid): how many events, on which index, and when the last one came."""

    index: int
    count: int
    last_unix: float


class XidState:
    """Counts and last-event times per (uuid, xid), loaded at start and saved at each event.

    >>> state = XidState(Path("/var/tmp/stabmon/.stabmon-daemon/xid.json"), limiter=limiter)
    >>> state.record(0, "GPU-5f2c", 79, now=1700000000.0)
    >>> state.entries()[("GPU-5f2c", 79)].count
    1

    ``path=None`` keeps the state in memory only.
    """

    def __init__(
        self,
        path: Path | None,
        *,
        limiter: LogLimiter,
        uid: Callable[[], int] = os.geteuid,
    ) -> None:
        self._path = path
        self._limiter = limiter
        self._uid = uid
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, int], XidEntry] = {}
        if path is not None and self._usable_directory(path.parent, create=False):
            self._entries = self._load(path)

    def entries(self) -> dict[tuple[str, int], XidEntry]:
        """A copy of every (uuid, xid) entry, safe from any thread."""
        with self._lock:
            return dict(self._entries)

    def counts(self) -> dict[tuple[int, str, int], int]:
        """Counts keyed as the XID watcher keys them: (gpu index, uuid, xid)."""
        return {(e.index, uuid, xid): e.count for (uuid, xid), e in self.entries().items()}

    def record(self, index: int, uuid: str, xid: int, *, now: float) -> None:
        """Count one event and save the state (a failure to save is logged, never raised)."""
        with self._lock:
            key = (uuid, xid)
            previous = self._entries.get(key)
            if previous is None and len(self._entries) >= MAX_ENTRIES:
                return  # bounded: a flood of made-up xids cannot grow the file or the series
            count = previous.count + 1 if previous is not None else 1
            self._entries[key] = XidEntry(index, count, now)
            snapshot = dict(self._entries)
        if self._path is not None:
            self._save(self._path, snapshot)

    def _save(self, path: Path, entries: dict[tuple[str, int], XidEntry]) -> None:
        if not self._usable_directory(path.parent, create=True):
            return
        data = [
            {"uuid": uuid, "xid": xid, "index": e.index, "count": e.count, "last_unix": e.last_unix}
            for (uuid, xid), e in sorted(entries.items())
        ]
        try:
            # rename(2) is atomic: a daemon killed mid-write leaves the old state, never half.
            write_atomic(path, json.dumps({"version": 1, "xids": data}).encode())
        except OSError as error:
            self._limiter.once(
                f"xid-state:save:{type(error).__name__}",
                logging.WARNING,
                "stabmon daemon: cannot save XID state to %s (%s); counts restart from zero "
                "when the daemon restarts",
                path,
                error,
            )

    def _usable_directory(self, directory: Path, *, create: bool) -> bool:
        """The daemon's own directory: created 0700, never one someone else made or linked."""
        try:
            if create and not os.path.lexists(directory):
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = os.lstat(directory)
        except FileNotFoundError:
            return False
        except OSError as error:
            self._refuse(directory, f"{type(error).__name__}: {error}")
            return False
        if not stat.S_ISDIR(info.st_mode):
            self._refuse(directory, "it is not a directory (a symlink or a file)")
            return False
        if info.st_uid != self._uid():
            self._refuse(directory, f"it belongs to uid {info.st_uid}, not to the daemon")
            return False
        return True

    def _refuse(self, directory: Path, reason: str) -> None:
        self._limiter.once(
            f"xid-state:refuse:{directory}",
            logging.WARNING,
            "stabmon daemon: not keeping XID state in %s: %s; remove it (the daemon creates "
            "its own) or XID counts restart from zero at each daemon restart",
            directory,
            reason,
        )

    def _load(self, path: Path) -> dict[tuple[str, int], XidEntry]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            return {}
        except OSError as error:
            self._ignore(path, f"{type(error).__name__}: {error}")
            return {}
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self._ignore(path, "not a regular file")
                return {}
            raw = os.read(fd, _MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
        try:
            if len(raw) > _MAX_FILE_BYTES:
                raise ValueError(f"larger than {_MAX_FILE_BYTES} bytes")
            return _parse(json.loads(raw))
        except (ValueError, UnicodeDecodeError) as error:
            self._ignore(path, str(error))
            return {}

    def _ignore(self, path: Path, reason: str) -> None:
        self._limiter.once(
            f"xid-state:load:{path}",
            logging.WARNING,
            "stabmon daemon: ignoring the XID state in %s (%s); counting from zero",
            path,
            reason,
        )


def _parse(document: object) -> dict[tuple[str, int], XidEntry]:
    if not isinstance(document, dict) or not isinstance(document.get("xids"), list):
        raise ValueError("not an XID state document")
    entries: dict[tuple[str, int], XidEntry] = {}
    for item in document["xids"][:MAX_ENTRIES]:
        if not isinstance(item, dict):
            raise ValueError(f"entry {item!r} is not an object")
        uuid, last = item.get("uuid"), item.get("last_unix")
        if not (isinstance(uuid, str) and len(uuid) <= 128):
            raise ValueError(f"uuid {uuid!r} is not a UUID string")
        if not isinstance(last, (int, float)) or isinstance(last, bool) or not math.isfinite(last):
            raise ValueError(f"last_unix {last!r} is not a time")
        xid, index, count = (_natural(item, name) for name in ("xid", "index", "count"))
        entries[(uuid, xid)] = XidEntry(index, count, float(last))
    return entries


def _natural(item: dict[str, object], name: str) -> int:
    value = item.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} {value!r} is not a non-negative integer")
    return value


class XidStateCollector(Collector):
    """``stabmon_gpu_xid_last_event_timestamp_seconds`` from the state (no NVML here)."""

    def __init__(self, state: XidState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        entries = sorted(self._state.entries().items())
        yield family(
            GPU_XID_LAST_EVENT,
            [
                ([str(entry.index), uuid, str(xid)], entry.last_unix)
                for (uuid, xid), entry in entries
            ],
        )
