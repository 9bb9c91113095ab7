"""One registered training process at one poll, and the daemon's per-process families.

:class:`~stabmon.daemon.processes.ProcessTable` polls (psutil); this module holds what a
poll hands on, and turns the table's last poll into metric families at scrape (no psutil).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from stabmon.contract import HEARTBEAT_AGE, PROCESS_CPU_SECONDS, PROCESS_MEMORY, PROCESS_UP
from stabmon.export.families import family
from stabmon.shared.rundir import ProcessRecord

if TYPE_CHECKING:
    from stabmon.daemon.processes import ProcessTable

__all__ = ["ProcessCollector", "ProcessSample"]


@dataclass(frozen=True)
class ProcessSample:
    """One registered training process at one poll."""

    record: ProcessRecord
    #: The pid exists, its create time matches the record's, and it has not recorded an exit.
    alive: bool
    #: The pid exists but belongs to another process (the training process is gone).
    reused: bool
    #: User + system CPU seconds of the main process; None when not alive or unreadable.
    main_cpu_seconds: float | None
    #: CPU seconds of every child ever seen (recursive), accumulated so it never decreases.
    workers_cpu_seconds: float | None
    #: PSS of the main process (RSS where PSS cannot be read).
    main_memory_bytes: float | None
    #: Sum of the PSS (or RSS) of all children, recursive.
    workers_memory_bytes: float | None
    #: Seconds since the last step, or since attach before the first step; None when unknown.
    heartbeat_age_seconds: float | None
    #: Pids of the process's children (recursive) seen in this poll: its DataLoader workers.
    worker_pids: tuple[int, ...] = ()
    #: The record's exporter port, verified as listening in the process's network namespace
    #: and owned by its uid (:mod:`stabmon.daemon.trust`); None when not verified.
    target_port: int | None = None
    #: Owner uid of the record's file (for a live process, the uid that runs it): the node's
    #: hang verdict judges each run's ranks per user (:mod:`stabmon.daemon.hang`).
    uid: int | None = None


class ProcessCollector(Collector):
    """The per-process families of the daemon, from the table's last poll (no psutil here)."""

    def __init__(self, table: ProcessTable) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        samples = self._table.samples()
        up = family(PROCESS_UP)
        age = family(HEARTBEAT_AGE)
        cpu = family(PROCESS_CPU_SECONDS)
        memory = family(PROCESS_MEMORY)
        for sample in samples:
            rank, run = str(sample.record.rank), sample.record.run
            up.add_metric([rank, run, str(sample.record.pid)], 1.0 if sample.alive else 0.0)
            if sample.heartbeat_age_seconds is not None:  # a dead process's age keeps growing
                age.add_metric([rank, run], sample.heartbeat_age_seconds)
            for scope, seconds in (
                ("main", sample.main_cpu_seconds),
                ("workers", sample.workers_cpu_seconds),
            ):
                if seconds is not None:
                    cpu.add_metric([rank, run, scope], seconds)
            if not sample.alive:
                continue
            for scope, size in (
                ("main", sample.main_memory_bytes),
                ("workers", sample.workers_memory_bytes),
            ):
                if size is not None:
                    memory.add_metric([rank, run, scope], size)
        yield from (up, age, cpu, memory)
