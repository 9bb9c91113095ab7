"""XID events: the driver's critical GPU errors, counted per (gpu index, uuid, xid) and logged.

Design
------
``nvmlEventSetWait`` blocks, so XID events get their own daemon thread instead
of a slot in the poll loop. :meth:`XidWatcher.start` always starts it, NVML or
not: the thread registers the events once NVML is up (it asks ``nvml_up``,
which costs no NVML call), waits at most ``wait_ms`` at a time, and checks its
stop flag between waits, so :meth:`XidWatcher.stop` returns within a second.
A failed registration is retried every ``retry_seconds`` (10 s). A failed wait
resets the event set, which may be broken for good (a lost GPU), and registers
a new one after the same pause, so the thread resumes by itself once the
poller has re-initialised NVML. The thread owns the counts; the scrape thread
reads copies under a lock. Each iteration runs under the guard (component
``xid``); NVML failures are expected and only logged, once per registration.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from stabmon.daemon.xid_state import XidState
from stabmon.hardware.nvml import GpuIdentity, NvmlError, NvmlReader
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter
from stabmon.shared.threads import start_without_signals

__all__ = ["XidWatcher"]

_COMPONENT = "xid"


class XidWatcher:
    """Reads NVML XID events in its own thread, counting them per (gpu index, uuid, xid).

    Example::

        watcher = XidWatcher(reader, lambda: poller.snapshot().identities, guard=guard,
                             limiter=limiter)
        watcher.start()  # registers whenever NVML is (or becomes) up; logs once if it cannot
        watcher.counts()  # {(0, "GPU-5f2c...", 79): 1}
        watcher.stop()

    ``nvml_up`` says whether NVML is initialised; by default, whether ``identities``
    lists any GPU (the poller's snapshot lists none while NVML is down).
    """

    def __init__(
        self,
        reader: NvmlReader,
        identities: Callable[[], Sequence[GpuIdentity]],
        *,
        guard: Guard,
        limiter: LogLimiter,
        wait_ms: int = 500,
        retry_seconds: float = 10.0,
        nvml_up: Callable[[], bool] | None = None,
        state: XidState | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._reader = reader
        self._identities = identities
        self._nvml_up = nvml_up if nvml_up is not None else lambda: bool(identities())
        self._guard = guard
        self._limiter = limiter
        self._wait_ms = wait_ms
        self._retry_seconds = retry_seconds
        # Counts continue from the saved state, so a daemon restart is no counter reset.
        self._state = state
        self._clock = clock
        self._counts: dict[tuple[int, str, int], int] = state.counts() if state else {}
        self._lock = threading.Lock()
        self._registered = False
        self._registrations = 0  # in log keys: each registration re-arms the failure messages
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stabmon-daemon-xid", daemon=True)

    def start(self) -> bool:
        """Start the thread; True when it runs, False once stopped (a watcher runs once)."""
        if self._stopping.is_set():
            return False
        if self._thread.ident is None:
            start_without_signals(self._thread)
        return True

    def request_stop(self) -> None:
        """Ask the thread to end without waiting (to stop several against one deadline)."""
        self._stopping.set()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the thread, waiting up to ``timeout`` seconds (one wait, at most half a second)."""
        self.request_stop()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(timeout, 0.0))

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
        """Register if needed, then wait for events once; return the pause before the next step."""
        if not self._registered:
            if not self._nvml_up():
                return self._wait_ms / 1000.0  # costs no NVML call: look again soon
            try:
                self._reader.start_xid_events()
            except NvmlError as error:
                self._limiter.once(
                    f"xid:{self._registrations}:register:{error}",
                    logging.WARNING,
                    "stabmon daemon: XID events unavailable, so XID errors are not counted: %s",
                    error,
                )
                return self._retry_seconds
            self._registered = True
            self._registrations += 1
            if self._registrations > 1:
                self._limiter.limited(
                    "xid:resumed", logging.INFO, "stabmon daemon: XID events resumed"
                )
        try:
            events = self._reader.wait_xid(self._wait_ms)
        except NvmlError as error:
            self._registered = False
            self._reader.reset_xid_events()  # the set may be broken for good: register anew
            self._limiter.once(
                f"xid:{self._registrations}:wait:{error}",
                logging.WARNING,
                "stabmon daemon: waiting for XID events failed (%s); retrying every %.0f s",
                error,
                self._retry_seconds,
            )
            return self._retry_seconds
        for index, xid in events:
            self._record(index, xid)
        return 0.0

    def _record(self, index: int, xid: int) -> None:
        uuid = next((gpu.uuid for gpu in self._identities() if gpu.index == index), "unknown")
        with self._lock:
            key = (index, uuid, xid)
            self._counts[key] = self._counts.get(key, 0) + 1
        if self._state is not None:
            self._state.record(index, uuid, xid, now=self._clock())
        self._limiter.limited(
            f"xid:{index}:{xid}",
            logging.ERROR,
            "stabmon daemon: XID %d on GPU %d (%s): the driver reported a GPU error; look the "
            "XID up in NVIDIA's XID catalogue for its cause and remedy",
            xid,
            index,
            uuid,
        )
