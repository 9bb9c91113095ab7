"""XID events: the driver's critical GPU errors, counted per (gpu index, uuid, xid) and logged.

Design
------
``nvmlEventSetWait`` blocks, so XID events get their own daemon thread instead
of a slot in the poll loop. The thread waits at most ``wait_ms`` at a time and
checks its stop flag between waits, so :meth:`XidWatcher.stop` returns within a
second. The thread owns the counts; the scrape thread reads copies under a
lock. Each iteration runs under the guard (component ``xid``). When NVML stops
answering, the thread logs it once and re-registers the events every 10 s, so
it resumes by itself once the poller has re-initialised NVML.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from stabmon.daemon.nvml import GpuIdentity, NvmlError, NvmlReader
from stabmon.guard import Guard
from stabmon.log import LogLimiter

__all__ = ["XidWatcher"]

_COMPONENT = "xid"
_REREGISTER_SECONDS = 10.0


class XidWatcher:
    """Reads NVML XID events in its own thread, counting them per (gpu index, uuid, xid).

    Example::

        watcher = XidWatcher(reader, lambda: poller.snapshot().identities, guard=guard,
                             limiter=limiter)
        if watcher.start():  # False on GPUs (or nodes) without XID events
            ...
        watcher.counts()  # {(0, "GPU-5f2c...", 79): 1}
        watcher.stop()
    """

    def __init__(
        self,
        reader: NvmlReader,
        identities: Callable[[], Sequence[GpuIdentity]],
        *,
        guard: Guard,
        limiter: LogLimiter,
        wait_ms: int = 500,
    ) -> None:
        self._reader = reader
        self._identities = identities
        self._guard = guard
        self._limiter = limiter
        self._wait_ms = wait_ms
        self._counts: dict[tuple[int, str, int], int] = {}
        self._lock = threading.Lock()
        self._registered = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stabmon-daemon-xid", daemon=True)

    def start(self) -> bool:
        """Register for XID events and start the thread; False (logged once) where unsupported."""
        if self._thread.ident is not None:  # started before: a thread runs only once
            return self._thread.is_alive()
        try:
            self._reader.start_xid_events()
        except NvmlError as error:
            self._limiter.once(
                "xid:start",
                logging.WARNING,
                "stabmon daemon: XID events unavailable, so XID errors are not counted: %s",
                error,
            )
            return False
        self._registered = True
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop the thread; returns within a second (one wait timeout, then the join)."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def counts(self) -> dict[tuple[int, str, int], int]:
        """XID events seen so far, by (gpu index, uuid, xid): a copy, safe from any thread."""
        with self._lock:
            return dict(self._counts)

    def _run(self) -> None:
        while not self._stopping.is_set():
            pause = self._wait_ms / 1000.0  # a contained failure must not become a busy loop
            with self._guard.contain(_COMPONENT):
                pause = self._step()
            if pause > 0:
                self._stopping.wait(pause)

    def _step(self) -> float:
        """Wait for events once (re-registering first if NVML failed); return the pause after."""
        if not self._registered:
            try:
                self._reader.start_xid_events()
            except NvmlError:
                return _REREGISTER_SECONDS
            self._registered = True
            self._limiter.limited("xid:resumed", logging.INFO, "stabmon daemon: XID events resumed")
        try:
            events = self._reader.wait_xid(self._wait_ms)
        except NvmlError as error:
            self._registered = False
            self._limiter.once(
                f"xid:wait:{error}",
                logging.WARNING,
                "stabmon daemon: waiting for XID events failed (%s); retrying every %.0f s",
                error,
                _REREGISTER_SECONDS,
            )
            return _REREGISTER_SECONDS
        for index, xid in events:
            self._record(index, xid)
        return 0.0

    def _record(self, index: int, xid: int) -> None:
        uuid = next((gpu.uuid for gpu in self._identities() if gpu.index == index), "unknown")
        with self._lock:
            key = (index, uuid, xid)
            self._counts[key] = self._counts.get(key, 0) + 1
        self._limiter.limited(
            f"xid:{index}:{xid}",
            logging.ERROR,
            "stabmon daemon: XID %d on GPU %d (%s): the driver reported a GPU error; look the "
            "XID up in NVIDIA's XID catalogue for its cause and remedy",
            xid,
            index,
            uuid,
        )
