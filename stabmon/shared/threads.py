"""Starting stabmon's threads so that the process's signals still reach the main thread.

Linux hands a signal sent to a process to any one of its threads that does not block it.
Python runs its signal handlers in the main thread only, and only a signal delivered to the
main thread interrupts what it is blocked in (a ``time.sleep``, a lock, a ``select``). So
once stabmon's threads exist, a SIGTERM or SIGINT could land on one of them while the main
thread sleeps: the user's handler (or Python's KeyboardInterrupt) would then wait until the
main thread woke up by itself, and a job's graceful shutdown would hang for as long as that.
Every thread stabmon starts therefore blocks the asynchronous signals, and the kernel gives
them to the main thread as it would without stabmon. The signals a fault raises in the
faulting thread itself (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS) and SIGABRT stay
open, so a crash in one of stabmon's threads still ends the process as before.

The mask is set in the starting thread around ``Thread.start`` (a new thread inherits its
creator's mask), not in the new thread's first line, so there is no moment at which the new
thread can take a signal. A signal that arrives meanwhile is held pending, not lost, and
delivered once the starting thread's mask is back.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["start_without_signals"]

_LEFT_OPEN = {
    signal.SIGSEGV,
    signal.SIGBUS,
    signal.SIGFPE,
    signal.SIGILL,
    signal.SIGTRAP,
    signal.SIGSYS,
    signal.SIGABRT,
}


def start_without_signals(thread: threading.Thread) -> None:
    """``thread.start()``, with the process's asynchronous signals blocked in ``thread``."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to route
        thread.start()
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - _LEFT_OPEN)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
