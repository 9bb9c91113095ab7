"""The training processes registered in the run directory, followed with psutil.

Design
------
The daemon's poll thread calls :meth:`ProcessTable.poll`: it reads the
registration records (:func:`stabmon.rundir.read_records`), samples each
process with psutil and replaces the table's list of samples in one
assignment. :class:`ProcessCollector` runs in the exporter's thread and reads
that list only, so a scrape never touches psutil or the disk, and it sees one
whole poll or the next, never half of one (the samples are frozen).

A pid alone does not name a process: the record's ``create_time`` must match
psutil's too, or the pid now belongs to another program. A dead process stays
exported with ``stabmon_process_up 0`` until its record is removed or it has
been dead for ``forget_after_seconds``, so a node that runs jobs for months
keeps a bounded set of series.

Worker CPU is a counter, yet workers come and go (a DataLoader without
persistent workers starts new ones every epoch). The table keeps the last CPU
time of each child, keyed by pid and create time, and adds only the growth to
a running total, so a worker that exits takes nothing away. The CPU a worker
spends between its last poll and its exit is not seen (at most one interval).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stabmon.contract import DAEMON_METRICS, MetricDef
from stabmon.log import LogLimiter
from stabmon.rundir import ProcessRecord, read_records

__all__ = ["ProcessCollector", "ProcessSample", "ProcessTable"]

#: psutil derives create_time from boot time and clock ticks; allow for their rounding.
_CREATE_TIME_TOLERANCE_SECONDS = 0.5
#: A child not seen for this long has exited; its CPU stays in the total, its entry goes.
_CHILD_MEMORY_SECONDS = 300.0

_RecordKey = tuple[str, int, int, float]  # run, rank, pid, create_time
_ChildKey = tuple[int, float]  # pid, create_time


def _metric(name: str) -> MetricDef:
    return next(definition for definition in DAEMON_METRICS if definition.name == name)


_PROCESS_UP = _metric("stabmon_process_up")
_HEARTBEAT_AGE = _metric("stabmon_heartbeat_age_seconds")
_CPU_SECONDS = _metric("stabmon_process_cpu_seconds_total")
_MEMORY_BYTES = _metric("stabmon_process_memory_bytes")


@dataclass(frozen=True)
class ProcessSample:
    """One registered training process at one poll."""

    record: ProcessRecord
    #: The pid exists and its create time matches the record's.
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
    #: Seconds since the last completed step; None before the first step.
    heartbeat_age_seconds: float | None


class _WorkerLedger:
    """The CPU of one process's children, as a total that never decreases."""

    def __init__(self) -> None:
        self.total = 0.0
        self._children: dict[_ChildKey, tuple[float, float]] = {}  # -> (cpu seconds, last seen)

    def observe(self, child: _ChildKey, cpu_seconds: float, now: float) -> None:
        counted = self._children[child][0] if child in self._children else 0.0
        if cpu_seconds > counted:
            self.total += cpu_seconds - counted
            counted = cpu_seconds
        self._children[child] = (counted, now)

    def forget_before(self, cutoff: float) -> None:
        for child in [key for key, (_, seen) in self._children.items() if seen < cutoff]:
            del self._children[child]


class ProcessTable:
    """Follows the training processes registered in the run directory (psutil).

    >>> table = ProcessTable(Path("/var/tmp/stabmon"), limiter=LogLimiter())
    >>> samples = table.poll()  # on the daemon's poll thread
    >>> table.samples() == samples  # what the collector reads at scrape time
    True
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        limiter: LogLimiter,
        clock: Callable[[], float] = time.time,
        forget_after_seconds: float = 3600.0,
    ) -> None:
        self._run_dir = run_dir
        self._limiter = limiter
        self._clock = clock
        self._forget_after = forget_after_seconds
        self._samples: tuple[ProcessSample, ...] = ()
        self._dead_since: dict[_RecordKey, float] = {}
        self._ledgers: dict[_RecordKey, _WorkerLedger] = {}
        self._run_dir_present: bool | None = None

    def poll(self) -> list[ProcessSample]:
        """Read the records and sample every process; never raises for OS or psutil errors."""
        now = self._clock()
        if not self._run_dir_exists():
            self._dead_since.clear()
            self._ledgers.clear()
            self._samples = ()
            return []
        records, problems = read_records(self._run_dir)
        for problem in problems:
            self._limiter.once(
                f"record:{problem.path}:{problem.reason}",
                logging.WARNING,
                "stabmon daemon: skipping %s, not a usable registration record: %s",
                problem.path,
                problem.reason,
            )
        chosen: dict[tuple[str, int], ProcessSample] = {}
        for record in records:
            key = _record_key(record)
            died = self._dead_since.get(key)
            if died is not None and now - died > self._forget_after:
                continue  # long dead: dropped, so series do not pile up
            sample = self._sample(record, key, now)
            if sample.alive:
                self._dead_since.pop(key, None)
            else:
                self._dead_since.setdefault(key, now)
                self._ledgers.pop(key, None)
            identity = (record.run, record.rank)
            if identity in chosen:
                self._limiter.once(
                    f"duplicate:{record.run}:{record.rank}",
                    logging.WARNING,
                    "stabmon daemon: more than one record for rank %d of run %s; "
                    "following the live or most recently updated one",
                    record.rank,
                    record.run,
                )
                sample = _preferred(chosen[identity], sample)
            chosen[identity] = sample
        current = {_record_key(record) for record in records}
        for table in (self._dead_since, self._ledgers):
            for key in [key for key in table if key not in current]:
                del table[key]  # record removed: the process is no longer monitored
        self._samples = tuple(chosen.values())
        return list(self._samples)

    def samples(self) -> list[ProcessSample]:
        """The samples of the last poll (what the collector exports)."""
        return list(self._samples)

    def _run_dir_exists(self) -> bool:
        present = self._run_dir.is_dir()
        if not present and self._run_dir_present is not False:
            self._limiter.limited(
                f"run-dir:{self._run_dir}",
                logging.WARNING if self._run_dir_present else logging.INFO,
                "stabmon daemon: run directory %s %s; no training processes to follow",
                self._run_dir,
                "disappeared" if self._run_dir_present else "does not exist yet",
            )
        self._run_dir_present = present
        return present

    def _sample(self, record: ProcessRecord, key: _RecordKey, now: float) -> ProcessSample:
        age = None if record.last_step_unix is None else max(0.0, now - record.last_step_unix)
        try:
            process = psutil.Process(record.pid)
            with process.oneshot():
                if abs(process.create_time() - record.create_time) > _CREATE_TIME_TOLERANCE_SECONDS:
                    return _not_alive(record, age, reused=True)
                if process.status() == psutil.STATUS_ZOMBIE:
                    return _not_alive(record, age, reused=False)
                times = process.cpu_times()
                main_memory = _memory_bytes(process)
            ledger = self._ledgers.setdefault(key, _WorkerLedger())
            workers_memory = self._sample_children(process, ledger, now)
        except psutil.NoSuchProcess:  # includes ZombieProcess
            return _not_alive(record, age, reused=False)
        except (psutil.Error, OSError) as error:
            self._limiter.once(
                f"unreadable:{record.pid}:{type(error).__name__}",
                logging.WARNING,
                "stabmon daemon: cannot read process %d (rank %d of run %s): %s: %s; "
                "reporting only whether it exists",
                record.pid,
                record.rank,
                record.run,
                type(error).__name__,
                error,
            )
            exists = psutil.pid_exists(record.pid)
            return ProcessSample(record, exists, False, None, None, None, None, age)
        return ProcessSample(
            record=record,
            alive=True,
            reused=False,
            main_cpu_seconds=times.user + times.system,
            workers_cpu_seconds=ledger.total,
            main_memory_bytes=main_memory,
            workers_memory_bytes=workers_memory,
            heartbeat_age_seconds=age,
        )

    def _sample_children(self, process: psutil.Process, ledger: _WorkerLedger, now: float) -> float:
        """Add the children's CPU growth to ``ledger``; return their summed memory."""
        memory = 0.0
        for child in process.children(recursive=True):
            try:
                with child.oneshot():
                    times = child.cpu_times()
                    ledger.observe((child.pid, child.create_time()), times.user + times.system, now)
                memory += _memory_bytes(child)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # exited (or was reaped) between listing and reading
        ledger.forget_before(now - _CHILD_MEMORY_SECONDS)
        return memory


class ProcessCollector(Collector):
    """The per-process families of the daemon, from the table's last poll (no psutil here)."""

    def __init__(self, table: ProcessTable) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        samples = self._table.samples()
        up = _gauge(_PROCESS_UP)
        age = _gauge(_HEARTBEAT_AGE)
        cpu = CounterMetricFamily(_CPU_SECONDS.name, _CPU_SECONDS.help, labels=_CPU_SECONDS.labels)
        memory = _gauge(_MEMORY_BYTES)
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


def _gauge(definition: MetricDef) -> GaugeMetricFamily:
    return GaugeMetricFamily(definition.name, definition.help, labels=definition.labels)


def _record_key(record: ProcessRecord) -> _RecordKey:
    return (record.run, record.rank, record.pid, record.create_time)


def _not_alive(record: ProcessRecord, age: float | None, *, reused: bool) -> ProcessSample:
    return ProcessSample(record, False, reused, None, None, None, None, age)


def _preferred(first: ProcessSample, second: ProcessSample) -> ProcessSample:
    if first.alive != second.alive:
        return first if first.alive else second
    return first if first.record.updated_unix >= second.record.updated_unix else second


def _memory_bytes(process: psutil.Process) -> float:
    """PSS, which shares copy-on-write pages fairly between workers; RSS where PSS is unknown."""
    try:
        # getattr: macOS and Windows have no pss field.
        pss = getattr(process.memory_full_info(), "pss", None)
    except psutil.AccessDenied:  # smaps is readable only by the owner (or root)
        pss = None
    if isinstance(pss, int):
        return float(pss)
    return float(process.memory_info().rss)
