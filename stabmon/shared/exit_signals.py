"""SIGTERM, recorded in the registration record, without changing what SIGTERM does.

SIGTERM's default action ends a process on the spot: no ``atexit``, no exit record, so the
node daemon could not tell a preemption, a scheduler's cancel or torchrun tearing down the
siblings of a crashed rank from SIGKILL or a segfault, and paged all of them as crashes.

Design
------
Installed only from the main thread, and only while SIGTERM still has its default action
and no wakeup fd is in use: a framework's own handler (Lightning's, an asyncio loop's) is
left alone, and then nothing changes. Python runs signal handlers in the main thread only,
between bytecodes, so a main thread blocked in a C call (a hung collective) would sit on a
Python-level handler, and the process would outlive the SIGTERM meant to end it. So the
work is not done by the handler: Python's C-level handler writes the signal number to the
wakeup fd at once, whatever the main thread does; a thread of ours reads it, writes the
exit record ("signal", "SIGTERM"), puts SIGTERM's default action back and sends SIGTERM to
the process again, which then ends exactly as it would have without stabmon: killed by
SIGTERM, exit status -15, no ``atexit``. The Python-level handler, if the main thread gets
there first, only waits (at most 2 s) for the thread, and never records itself: it may have
interrupted the main thread inside the registration's lock.

A forked child (a DataLoader worker) inherits the handler and the wakeup fd, which would
carry its own SIGTERM to the parent's thread: an ``os.register_at_fork`` hook gives the
child the default action and no wakeup fd before it runs code of its own (SIGTERM is blocked
in the forking thread across the fork, so none arrives in between). A child started by
``subprocess`` (fork, then exec, in C) holds the pipe only until its exec. ``uninstall``
(at detach, from the main thread) restores both; from another thread it only forgets the
record, and SIGTERM keeps its default effect.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from stabmon.shared.threads import start_without_signals

__all__ = ["SigtermRecorder"]

_STOP = b"\x00"
#: How long the main thread's handler lets the thread write the record before it ends the
#: process itself (the record is one small file written with a rename).
_HANDLER_WAIT_SECONDS = 2.0


class SigtermRecorder:
    """Calls ``record()`` when SIGTERM arrives, then lets SIGTERM end the process as usual.

    >>> recorder = SigtermRecorder.install(lambda: registration.exited("signal", time.time(),
    ...                                                                signal_name="SIGTERM"))
    >>> recorder.uninstall()  # at detach; None was returned where it could not be installed
    """

    _active: SigtermRecorder | None = None
    _fork_hook = False
    _forking = threading.local()  # per forking thread: whether SIGTERM was blocked already

    def __init__(self, record: Callable[[], None], read_fd: int, write_fd: int) -> None:
        self._record: Callable[[], None] | None = record
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stabmon-sigterm", daemon=True)

    @classmethod
    def install(cls, record: Callable[[], None]) -> SigtermRecorder | None:
        """Install for ``record``; None where SIGTERM is not ours to watch (see the module)."""
        if threading.current_thread() is not threading.main_thread() or cls._active is not None:
            return None
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return None
        read_fd, write_fd = os.pipe()  # non-inheritable: an exec'd child never holds it
        os.set_blocking(write_fd, False)  # set_wakeup_fd needs it; the C handler must not block
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:  # someone else's wakeup fd (an event loop): leave it theirs
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return None
        recorder = cls(record, read_fd, write_fd)
        signal.signal(signal.SIGTERM, recorder._on_signal)
        cls._active = recorder
        if not cls._fork_hook:
            os.register_at_fork(
                before=cls._before_fork,
                after_in_parent=cls._after_fork_in_parent,
                after_in_child=cls._after_fork_in_child,
            )
            cls._fork_hook = True
        start_without_signals(recorder._thread)
        return recorder

    def uninstall(self) -> None:
        """Stop recording; on the main thread, give SIGTERM and the wakeup fd back."""
        with self._lock:
            self._record = None
        if threading.current_thread() is not threading.main_thread():
            return  # the handler and the thread stay, and still end the process on SIGTERM
        if signal.getsignal(signal.SIGTERM) == self._on_signal:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        current = signal.set_wakeup_fd(-1)
        if current not in (-1, self._write_fd):
            signal.set_wakeup_fd(current)  # someone replaced ours since: theirs stays
        type(self)._active = None
        try:
            os.write(self._write_fd, _STOP)
        except OSError:
            pass
        self._thread.join(1.0)
        if not self._thread.is_alive():
            os.close(self._read_fd)
            os.close(self._write_fd)

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data or _STOP in data:
                return
            if signal.SIGTERM in data:  # other bytes are other signals (SIGCHLD, SIGINT)
                self._end_by_sigterm()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # The thread records and ends the process. The main thread must not record itself: it
        # may have been interrupted holding the registration's lock, and would wait for it
        # forever. If the thread is gone (uninstalled elsewhere), SIGTERM ends it unrecorded.
        if self._thread.is_alive():
            self._ended.wait(_HANDLER_WAIT_SECONDS)
        _end_process()

    def _end_by_sigterm(self) -> None:
        with self._lock:
            record, self._record = self._record, None
        if record is not None:
            try:
                record()
            except Exception:  # the process is ending: whatever failed, SIGTERM must still end it
                pass
        self._ended.set()
        _end_process()

    @classmethod
    def _before_fork(cls) -> None:
        if cls._active is None:
            cls._forking.was_blocked = True  # nothing blocked here: nothing to undo after
            return
        # Until the child has let go of the wakeup fd, a SIGTERM sent to it would reach the
        # parent's thread: the forking thread blocks SIGTERM, and the child inherits the mask.
        # (A SIGTERM for the parent meanwhile waits until the fork is done, or goes to a thread
        # that does not block it: never one of stabmon's, see stabmon.shared.threads.)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        cls._forking.was_blocked = signal.SIGTERM in previous

    @classmethod
    def _after_fork_in_parent(cls) -> None:
        if not getattr(cls._forking, "was_blocked", True):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    @classmethod
    def _after_fork_in_child(cls) -> None:
        active, cls._active = cls._active, None
        was_blocked = getattr(cls._forking, "was_blocked", True)
        try:
            if active is not None:
                cls._let_go(active)
        finally:
            if not was_blocked:  # a SIGTERM that came meanwhile is delivered now, to the child
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    @classmethod
    def _let_go(cls, active: SigtermRecorder) -> None:
        # The C-level handler writes wherever the wakeup fd points: to /dev/null from now on,
        # even if the calls below cannot run (a fork from a thread that is not the main one).
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, active._write_fd, inheritable=False)
        finally:
            os.close(null)
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:
            pass  # the handler stays; it records nothing in a child and still ends it


def _end_process() -> None:
    """End the process as SIGTERM's default action does: killed by SIGTERM."""
    _default_action(signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)  # delivery is asynchronous; never return into the caller first


def _default_action(signum: int) -> None:
    """SIGTERM's default action back, from any thread (``signal.signal`` is main-thread only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(signum, None)  # SIG_DFL is the null handler
