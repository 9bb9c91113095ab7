"""What the daemon knows about each rank beyond up/down: its own stall limit, how it ended.

A frozen process (SIGSTOP, a C call that holds the GIL) cannot run its watchdog
or answer a scrape; only the daemon sees its heartbeat age. The age means
something only against that rank's own limit, which its heartbeat thread
writes into the registration record with the loop phase (``eval`` gets
``phase_stall_seconds``, a step loop its ``stall_seconds``):
``stabmon_process_stall_limit_seconds``. A process that is down is labelled
with how it ended, from its exit record: ``exception`` (an uncaught error),
``signal`` (a signal it recorded: SIGTERM, see :mod:`stabmon.shared.exit_signals`, or
Ctrl-C) or ``vanished`` (no exit record: SIGKILL, the OOM killer, a native
crash), so the rules page a crash and only warn of a termination.

The collector reads the process table's last poll, like
:class:`~stabmon.daemon.processes.ProcessCollector`: no psutil or disk at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

import psutil
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from stabmon.contract import HOST_MEMORY_TOTAL, PROCESS_EXIT_REASON, PROCESS_STALL_LIMIT
from stabmon.daemon.processes import ProcessSample, ProcessTable
from stabmon.export.families import family

__all__ = ["HostMemoryCollector", "LivenessCollector", "exit_reason"]


def exit_reason(sample: ProcessSample) -> str | None:
    """How a down process ended, from its record; None while it is alive."""
    if sample.alive:
        return None
    status = sample.record.exit_status
    if status == "exception":
        return "exception"
    if status == "signal":
        return "signal"
    return "vanished"  # no exit record, an unknown status, or its pid now names another process


class LivenessCollector(Collector):
    """Each rank's current stall limit and, once down, how it ended."""

    def __init__(self, table: ProcessTable) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        limit = family(PROCESS_STALL_LIMIT)
        reason = family(PROCESS_EXIT_REASON)
        for sample in self._table.samples():
            rank, run = str(sample.record.rank), sample.record.run
            if sample.record.stall_limit_seconds is not None:
                limit.add_metric([rank, run], sample.record.stall_limit_seconds)
            ended = exit_reason(sample)
            if ended is not None:
                reason.add_metric([rank, run, str(sample.record.pid), ended], 1.0)
        yield limit
        yield reason


class HostMemoryCollector(Collector):
    """The node's physical memory, what exhaustion forecasts compare workers' PSS with."""

    def __init__(self) -> None:
        self._total = float(psutil.virtual_memory().total)  # fixed while the node runs

    def collect(self) -> Iterator[Metric]:
        yield family(HOST_MEMORY_TOTAL, [((), self._total)])
