"""The training processes registered in the run directory, followed with psutil.

Design
------
The daemon's poll thread calls :meth:`ProcessTable.poll`: it reads the
registration records (:func:`stabmon.shared.rundir.read_records`), samples each
process with psutil and replaces the table's list of samples in one
assignment. :class:`ProcessCollector` runs in the exporter's thread and reads
that list only, so a scrape never touches psutil or the disk, and it sees one
whole poll or the next, never half of one (the samples are frozen).

A pid alone does not name a process: the record's ``create_time`` must match
psutil's too, or the pid now belongs to another program. Which records are
followed is decided from each record alone, never from the daemon's memory, so
a restarted daemon (or one on a rebooted node) reaches the same answer:

- a record written on another host, or during another boot of this one (a
  shared filesystem, or a record from before a reboot), is not this node's: skipped;
- a record whose process exited cleanly (``exit_status == "clean"``: the run
  ended without detach) is no failure: skipped;
- a record whose process is gone (crashed, killed, or ended by an uncaught
  exception) is exported with ``stabmon_process_up 0`` until its record is
  removed, or until it was last written more than ``forget_after_seconds``
  ago, so a node that runs jobs for months keeps a bounded set of series.

Worker CPU is a counter, yet workers come and go (a DataLoader without
persistent workers starts new ones every epoch). The table keeps the last CPU
time of each child, keyed by pid and create time, and adds only the growth to
a running total, so a worker that exits takes nothing away. The CPU a worker
spends between its last poll and its exit is not seen (at most one interval).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from stabmon.daemon import trust
from stabmon.daemon.pidns import Ambiguous, HostPids
from stabmon.daemon.process_metrics import ProcessCollector, ProcessSample
from stabmon.daemon.tree import ProcessTree
from stabmon.shared import rundir
from stabmon.shared.log import LogLimiter
from stabmon.shared.rundir import (
    OwnedRecord,
    ProcessRecord,
    ReadBudget,
    RecordProblem,
    RunPaths,
    check_root,
    read_owned_records,
)
from stabmon.shared.safefs import UnsafePathError

__all__ = ["ProcessCollector", "ProcessSample", "ProcessTable"]

#: psutil derives create_time from boot time and clock ticks; allow for their rounding.
_CREATE_TIME_TOLERANCE_SECONDS = 0.5
#: A child not seen for this long has exited; its CPU stays in the total, its entry goes.
_CHILD_MEMORY_SECONDS = 300.0
#: ``exit_status`` of a run that ended normally; any other status is a failure.
_CLEAN_EXIT = "clean"

#: Children (DataLoader workers) sampled per process at most: a record that names a process
#: with thousands of descendants (pid 1) must not stretch the poll for everyone else.
MAX_CHILDREN = 256
#: Seconds one record's children may take to sample; the rest wait for the next poll.
RECORD_BUDGET_SECONDS = 0.25
#: Unusable files logged one by one per owner uid and poll; the rest go into one summary line
#: a poll (rate-limited), so 20,000 junk files never flood the daemon's log.
LOGGED_PROBLEMS_PER_OWNER = 4
#: Seconds one poll may spend sampling processes; records past it keep their last sample
#: (the first MIN_SAMPLED are sampled whatever the time: a loaded node still makes progress).
POLL_SECONDS = 3.0
MIN_SAMPLED = 64

_RecordKey = tuple[str, int, int, float]  # run, rank, pid, create_time
_ChildKey = tuple[int, float]  # pid, create_time


@dataclass(frozen=True)
class _NodeReads:
    """What a poll reads of the whole node once and shares among its records."""

    sockets: trust.ListeningSockets  # each network namespace's socket tables
    tree: ProcessTree  # every process's parent


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

    ``boot_id`` says which node (and which boot of it) this is: records written
    on another host, or before a reboot, are skipped (an empty answer, or an
    empty field in a record, is not compared). The boot id, not the hostname:
    containers on one node (a DaemonSet beside training pods) share the kernel's
    boot id but each has a hostname of its own.

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
        boot_id: Callable[[], str] = rundir.boot_id,
        budget_clock: Callable[[], float] = time.monotonic,
        proc: Path = Path("/proc"),
        read_budget: ReadBudget | None = None,
        on_refused: Callable[[int], None] | None = None,
    ) -> None:
        self._run_dir = run_dir
        self._limiter = limiter
        self._clock = clock
        self._budget_clock = budget_clock
        self._proc = proc
        #: Record path -> (the time it said it was written, when that was seen on our clock).
        self._seen: dict[Path, tuple[float, float]] = {}
        self._forget_after = forget_after_seconds
        self._boot_id = boot_id
        self._samples: tuple[ProcessSample, ...] = ()
        #: The last sample of each record (by path), reused when a poll runs out of time.
        self._by_path: dict[Path, ProcessSample] = {}
        self._host_pids = HostPids(limiter=limiter)
        self._ledgers: dict[_RecordKey, _WorkerLedger] = {}
        self._run_dir_present: bool | None = None
        #: What one read of the run directory may cost (files per owner uid, seconds).
        self._read_budget = read_budget or ReadBudget(clock=budget_clock)
        #: Told how many records or roots this poll refused (the daemon counts them).
        self._on_refused = on_refused

    def poll(self) -> list[ProcessSample]:
        """Read the records and sample every process; never raises for OS or psutil errors."""
        now = self._clock()
        if not self._run_dir_exists():
            self._ledgers.clear()
            self._samples = ()
            return []
        if not self._root_is_safe():
            self._ledgers.clear()
            self._samples = ()
            return []
        owned, problems = read_owned_records(self._run_dir, budget=self._read_budget)
        self._report(problems)
        boot = self._boot_id()
        self._host_pids.new_poll([entry.record for entry in owned])
        node = _NodeReads(trust.ListeningSockets(self._proc), ProcessTree(self._proc))
        chosen: dict[tuple[str, int], ProcessSample] = {}
        followed: set[_RecordKey] = set()
        seen: dict[Path, tuple[float, float]] = {}
        by_path: dict[Path, ProcessSample] = {}
        deadline = self._budget_clock() + POLL_SECONDS
        late = 0
        for entry in owned:  # one user's records after another's in turn (read_owned_records)
            record = entry.record
            if not self._is_this_nodes(record, boot):
                continue
            if record.exit_status == _CLEAN_EXIT:
                continue  # finished normally without detach: nothing is down
            key = _record_key(record)
            if len(by_path) >= MIN_SAMPLED and self._budget_clock() > deadline:
                late += 1  # out of this poll's time: the last sample stands, if any
                last = self._by_path.get(entry.path)
                if last is None:
                    continue
                sample: ProcessSample | None = last
                if last.alive:
                    followed.add(key)
            else:
                sample = self._sample(entry, key, now, node)
            if sample is None:
                continue  # cannot tell which process it is, or may not believe it
            sample = replace(sample, uid=entry.owner_uid)
            by_path[entry.path] = sample
            written = _last_written(record)
            previous = self._seen.get(entry.path)
            if previous is not None and previous[0] == written:
                seen[entry.path] = previous
            else:  # new or rewritten: a time in the future is not believed, our clock is
                seen[entry.path] = (written, min(written, now))
            if sample.alive:
                followed.add(key)
            elif now - seen[entry.path][1] > self._forget_after:
                continue  # long dead by our own clock: dropped, so series do not pile up
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
        self._seen = seen
        self._by_path = by_path
        if late:
            self._limiter.limited(
                "poll:late",
                logging.WARNING,
                "stabmon daemon: a poll ran out of its %.1f s; %d record(s) keep their last "
                "sample until the next",
                POLL_SECONDS,
                late,
            )
        for key in [key for key in self._ledgers if key not in followed]:
            del self._ledgers[key]  # dead or deregistered: its workers are no longer counted
        # Live processes first: what reads the samples in order sees them before the dead.
        self._samples = tuple(sorted(chosen.values(), key=lambda sample: not sample.alive))
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

    def _root_is_safe(self) -> bool:
        """The root is checked at every poll: it may be swapped for a symlink at any time."""
        try:
            check_root(self._run_dir)
        except UnsafePathError as error:
            self._limiter.limited(
                f"unsafe-root:{self._run_dir}",
                logging.ERROR,
                "stabmon daemon: not reading the run directory: %s; following no process "
                'until it is fixed (counted in stabmon_internal_errors_total{component="rundir"})',
                error,
            )
            if self._on_refused is not None:
                self._on_refused(1)
            return False
        return True

    def _report(self, problems: list[RecordProblem]) -> None:
        """Log a few problems per owner uid one by one, the rest in one line; count refusals.

        Each file is logged once (by path and reason) while the limiter remembers it, at most
        a few new lines per owner uid a poll; the rest wait for later polls and are summed up
        in one rate-limited line, so no user can flood the log with junk files, nor push
        another user's problems out of it.
        """
        logged: dict[int | None, int] = {}
        beyond: dict[int | None, int] = {}
        refused = 0
        for problem in problems:
            refused += problem.refused
            owner = problem.owner_uid
            if logged.get(owner, 0) >= LOGGED_PROBLEMS_PER_OWNER:
                beyond[owner] = beyond.get(owner, 0) + 1  # logged at a later poll, or summed
                continue
            if self._limiter.once(
                f"record:{problem.path}:{problem.reason}",
                logging.WARNING,
                "stabmon daemon: skipping %s (owner uid %s), not a usable registration record: %s",
                problem.path,
                "unknown" if owner is None else owner,
                problem.reason,
            ):
                logged[owner] = logged.get(owner, 0) + 1
        if beyond:
            self._limiter.limited(
                "record:summary",
                logging.WARNING,
                "stabmon daemon: this poll skipped %d more unusable record file(s), by owner "
                "uid: %s (logged %d per owner and poll)",
                sum(beyond.values()),
                ", ".join(
                    f"{owner}: {count}"
                    for owner, count in sorted(beyond.items(), key=lambda item: -item[1])[:8]
                ),
                LOGGED_PROBLEMS_PER_OWNER,
            )
        if refused and self._on_refused is not None:
            self._on_refused(refused)

    def _is_this_nodes(self, record: ProcessRecord, boot: str) -> bool:
        if not (record.boot_id and boot and record.boot_id != boot):
            return True
        reason = (
            f"it was written on another host or before a reboot (boot id {record.boot_id}, "
            f"here {boot}; host {record.hostname or 'unknown'})"
        )
        path = RunPaths(self._run_dir, record.run, record.rank).record
        self._limiter.once(
            f"foreign:{path}",
            logging.INFO,
            "stabmon daemon: ignoring the record of rank %d of run %s (%s): %s, "
            "so its pid names no process of this node",
            record.rank,
            record.run,
            path,
            reason,
        )
        return False

    def _sample(
        self, entry: OwnedRecord, key: _RecordKey, now: float, node: _NodeReads
    ) -> ProcessSample | None:
        record = entry.record
        age = _heartbeat_age(record, now)
        if record.exit_status is not None:
            return _not_alive(record, age, reused=False)  # it said it is exiting: down now
        host_pid = self._host_pids.resolve(record)
        if isinstance(host_pid, Ambiguous):
            return None
        if host_pid is None:  # a container's pid that no process here has: gone
            return _not_alive(record, age, reused=False)
        if host_pid != record.pid:  # follow, and label, the pid this node's tools use
            record = replace(record, pid=host_pid)
        try:
            process = psutil.Process(record.pid)
            with process.oneshot():
                if abs(process.create_time() - record.create_time) > _CREATE_TIME_TOLERANCE_SECONDS:
                    return _not_alive(record, age, reused=True)
                uid = process.uids().real
                if not trust.owner_may_speak_for(entry.owner_uid, uid, record.pid):
                    self._refuse(entry, uid)
                    return None
                if process.status() == psutil.STATUS_ZOMBIE:
                    return _not_alive(record, age, reused=False)
        except psutil.NoSuchProcess:  # includes ZombieProcess
            return _not_alive(record, age, reused=False)
        except (psutil.Error, OSError) as error:
            self._unreadable(record, error)
            return None  # who runs it cannot be read: neither believed up nor down
        try:
            with process.oneshot():
                times = process.cpu_times()
                main_memory = self._memory_bytes(process, record, worker=False)
            ledger = self._ledgers.setdefault(key, _WorkerLedger())
            workers_memory, workers = self._sample_children(process, record, ledger, now, node.tree)
        except psutil.NoSuchProcess:  # includes ZombieProcess
            return _not_alive(record, age, reused=False)
        except (psutil.Error, OSError) as error:
            self._unreadable(record, error)
            return ProcessSample(record, True, False, None, None, None, None, age)
        return ProcessSample(
            record=record,
            alive=True,
            reused=False,
            main_cpu_seconds=times.user + times.system,
            workers_cpu_seconds=ledger.total,
            main_memory_bytes=main_memory,
            workers_memory_bytes=workers_memory,
            heartbeat_age_seconds=age,
            worker_pids=workers,
            target_port=node.sockets.verified_port(record.pid, uid, record.metrics_url),
        )

    def _refuse(self, entry: OwnedRecord, uid: int) -> None:
        self._limiter.once(
            f"untrusted:{entry.path}",
            logging.WARNING,
            "stabmon daemon: ignoring %s: the file belongs to uid %d but process %d is run by "
            "uid %d; a record is believed only from the process's own user",
            entry.path,
            entry.owner_uid,
            entry.record.pid,
            uid,
        )

    def _unreadable(self, record: ProcessRecord, error: BaseException) -> None:
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

    def _sample_children(
        self,
        process: psutil.Process,
        record: ProcessRecord,
        ledger: _WorkerLedger,
        now: float,
        tree: ProcessTree,
    ) -> tuple[float, tuple[int, ...]]:
        """Add the children's CPU growth to ``ledger``; return their summed memory and pids."""
        memory = 0.0
        pids: list[int] = []
        deadline = self._budget_clock() + RECORD_BUDGET_SECONDS
        children = tree.descendants(process)
        if tree.unreadable:
            self._limiter.once(
                "tree-unreadable",
                logging.WARNING,
                "stabmon daemon: cannot read the parent of %d processes (/proc mounted with "
                "hidepid, or run by another user); DataLoader workers among them are not "
                "counted in the workers scope",
                tree.unreadable,
            )
        if len(children) > MAX_CHILDREN or self._budget_clock() > deadline:
            self._limiter.once(
                f"children:{record.run}:{record.rank}",
                logging.WARNING,
                "stabmon daemon: process %d (rank %d of run %s) has %d descendants; sampling "
                "the first %d, so one process cannot slow the poll of every other",
                record.pid,
                record.rank,
                record.run,
                len(children),
                MAX_CHILDREN,
            )
        for child in children[:MAX_CHILDREN]:
            if self._budget_clock() > deadline:
                break  # out of this record's time: the rest are sampled next poll
            try:
                with child.oneshot():
                    times = child.cpu_times()
                    ledger.observe((child.pid, child.create_time()), times.user + times.system, now)
                memory += self._memory_bytes(child, record, worker=True)
            except psutil.NoSuchProcess:
                continue  # exited (or was reaped) between listing and reading
            except psutil.AccessDenied:
                pids.append(child.pid)  # still a worker whose GPU use placement must see
                continue
            pids.append(child.pid)
        ledger.forget_before(now - _CHILD_MEMORY_SECONDS)
        return memory, tuple(pids)

    def _memory_bytes(
        self, process: psutil.Process, record: ProcessRecord, *, worker: bool
    ) -> float:
        """PSS, which shares copy-on-write pages fairly among workers; RSS where PSS is unknown."""
        try:
            # getattr: macOS and Windows have no pss field.
            pss = getattr(process.memory_full_info(), "pss", None)
        except psutil.AccessDenied:  # smaps is readable only by the owner (or root)
            pss = None
            self._limiter.once(
                f"pss-denied:{process.pid}",
                logging.WARNING,
                "stabmon daemon: may not read the PSS of process %d (%s rank %d of run %s); "
                "reporting its RSS, which counts shared copy-on-write pages in full, so the "
                "%s memory scope may be inflated. Reading PSS needs the daemon to run as the "
                "same user or with CAP_SYS_PTRACE",
                process.pid,
                "a worker of" if worker else "main process of",
                record.rank,
                record.run,
                "workers" if worker else "main",
            )
        if isinstance(pss, int):
            return float(pss)
        return float(process.memory_info().rss)


def _record_key(record: ProcessRecord) -> _RecordKey:
    return (record.run, record.rank, record.pid, record.create_time)


def _last_written(record: ProcessRecord) -> float:
    """When the process last wrote its record: its last heartbeat, or its exit."""
    return max(record.updated_unix, record.exited_unix or 0.0)


def _heartbeat_age(record: ProcessRecord, now: float) -> float | None:
    """Seconds since the last step, or since attach before the first step (a hang in init ages)."""
    if record.last_step_unix is not None:
        since = record.last_step_unix
    elif record.attached_unix > 0.0:
        since = record.attached_unix
    else:
        return None  # a record that says neither: no age to report
    return max(0.0, now - since)


def _not_alive(record: ProcessRecord, age: float | None, *, reused: bool) -> ProcessSample:
    return ProcessSample(record, False, reused, None, None, None, None, age)


def _preferred(first: ProcessSample, second: ProcessSample) -> ProcessSample:
    if first.alive != second.alive:
        return first if first.alive else second
    return first if first.record.updated_unix >= second.record.updated_unix else second
