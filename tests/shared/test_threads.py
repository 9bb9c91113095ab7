"""start_without_signals: stabmon's threads never take a signal meant for the main thread.

The masks are read from /proc (what the kernel itself consults). The delivery test runs in
a fresh interpreter without torch, whose import starts a thread of its own that would take
the signal too: there, the main thread and one of ours are the only threads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch
from conftest import MonitorFactory
from helpers import tiny_model

from stabmon.shared.threads import start_without_signals

ROOT = Path(__file__).resolve().parents[2]


def _blocked(native_id: int) -> set[int]:
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    (line,) = [line for line in status.splitlines() if line.startswith("SigBlk:")]
    mask = int(line.split()[1], 16)
    return {number for number in range(1, 65) if mask >> (number - 1) & 1}


def test_a_started_thread_blocks_the_process_signals_and_leaves_fault_signals_open() -> None:
    mask_before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    seen: list[set[int]] = []
    ready, done = threading.Event(), threading.Event()

    def body() -> None:
        seen.append(_blocked(threading.get_native_id()))
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=body, daemon=True)
    start_without_signals(thread)
    assert ready.wait(10)
    done.set()
    thread.join(10)
    (blocked,) = seen
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD"):
        assert getattr(signal, name) in blocked, name
    for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT"):
        assert getattr(signal, name) not in blocked, name
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == mask_before  # the caller's, back


_DELIVERY = """
import os, signal, threading, time
from stabmon.shared.background import PeriodicThread
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter
assert os.listdir("/proc/self/task") == [str(os.getpid())], "another thread exists already"
signal.signal(signal.SIGUSR1, lambda *_: None)
worker = PeriodicThread("stabmon-test", 0.01, lambda: None, guard=Guard(LogLimiter()),
                        component="test")
worker.start()
# The main thread blocks SIGUSR1 (as _posixsubprocess does around a vfork): the kernel hands
# a process-directed signal to any thread that does not block it, ours included if it let it.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(0.2)
print("pending" if signal.SIGUSR1 in signal.sigpending() else "taken by another thread")
worker.stop()
"""


def test_a_signal_the_main_thread_blocks_waits_for_it_instead_of_going_to_our_thread() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", _DELIVERY], env=env, capture_output=True,
                            text=True, timeout=120, check=True)  # fmt: skip
    assert result.stdout.strip() == "pending"


def test_every_thread_an_attached_monitor_starts_leaves_signals_to_the_main_thread(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ours = [thread for thread in threading.enumerate() if thread.name.startswith("stabmon-")]
    assert len(ours) >= 5  # the exporter, the sampler, the heartbeat, the watchdog...
    for thread in ours:
        assert thread.native_id is not None
        assert signal.SIGTERM in _blocked(thread.native_id), thread.name
