"""Pids of containerised training processes, as the daemon's PID namespace numbers them.

A training process in a container registers the pid it sees (often 1 or a small
number) and its PID namespace (``/proc/self/ns/pid``). The daemon runs in the
host's PID namespace (``hostPID: true`` on Kubernetes, ``pid: host`` in compose),
where the same process has another pid, the one psutil, NVML and ``kill`` use.
The kernel lists a process's pid in every namespace it belongs to, outermost
first, on the ``NSpid:`` line of ``/proc/<pid>/status``; so the host pid of
(namespace, pid) is the process whose namespace link names that namespace and
whose innermost ``NSpid`` is that pid.

The namespace link of another user's process is readable only with ptrace
access (root, or CAP_SYS_PTRACE), but ``NSpid`` and the start time are readable
by anyone; so a daemon without that access matches the innermost pid of a
process in a nested namespace and its create time, which the record carries.

Finding it means reading two files of every process on the node, so it is done
at most once per poll and only while some record is unresolved; resolved pids
are kept. A pid kept after its process exited is caught by the caller's
create-time check, like any reused pid.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import psutil

from stabmon.shared.log import LogLimiter
from stabmon.shared.rundir import ProcessRecord, pid_namespace

__all__ = ["AMBIGUOUS", "Ambiguous", "HostPids"]

_Key = tuple[str, int, float]  # namespace, pid in it, create time
#: psutil derives create times from clock ticks since boot, the same way in every namespace
#: of one kernel: a match is exact up to float rounding, well within one tick (10 ms).
CREATE_TIME_TOLERANCE_SECONDS = 0.005


class HostPids:
    """Maps a record's (namespace, pid) to the pid in the daemon's own PID namespace."""

    def __init__(self, *, limiter: LogLimiter, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._limiter = limiter
        self._own = pid_namespace(proc=proc)
        self._resolved: dict[_Key, int] = {}
        self._index: dict[int, list[tuple[str, int]]] | None = None

    def new_poll(self, records: list[ProcessRecord]) -> None:
        """Forget the last poll's scan, and the pids of records that are gone."""
        self._index = None
        live = {_key(record) for record in records}
        for key in [key for key in self._resolved if key not in live]:
            del self._resolved[key]

    def resolve(self, record: ProcessRecord) -> int | None | Ambiguous:
        """The pid to follow for ``record``: None when no process here is it, or AMBIGUOUS."""
        if not record.pid_namespace or not self._own or record.pid_namespace == self._own:
            return record.pid  # same namespace (or an old record, or no /proc): as written
        key = _key(record)
        if key in self._resolved:
            return self._resolved[key]
        if self._index is None:
            self._index = self._scan()
        host_pid = _choose(self._index.get(record.pid, []), record)
        if isinstance(host_pid, Ambiguous):
            self._limiter.once(
                f"pidns-ambiguous:{record.pid_namespace}:{record.pid}",
                logging.WARNING,
                "stabmon daemon: more than one process could be rank %d of run %s (pid %d of "
                "its namespace, started at the same instant); it is not followed. Run the "
                "daemon as root or with CAP_SYS_PTRACE so it can read PID namespace links",
                record.rank,
                record.run,
                record.pid,
            )
            return host_pid
        if host_pid is None:
            self._limiter.once(
                f"pidns:{record.pid_namespace}:{record.pid}",
                logging.WARNING,
                "stabmon daemon: rank %d of run %s registered pid %d of PID namespace %s, and "
                "no process of this node is that one: it exited, or the daemon does not share "
                "the host's PID namespace (Kubernetes: hostPID: true; compose: pid: host)",
                record.rank,
                record.run,
                record.pid,
                record.pid_namespace,
            )
            return None
        self._resolved[key] = host_pid
        return host_pid

    def _scan(self) -> dict[int, list[tuple[str, int]]]:
        """Innermost pid -> [(namespace or "" where unreadable, pid here)] of nested processes."""
        index: dict[int, list[tuple[str, int]]] = {}
        try:
            entries = os.listdir(self._proc)
        except OSError:
            return index
        for entry in entries:
            if not entry.isdigit():
                continue
            pids = _nspids(self._proc / entry / "status")
            if len(pids) < 2:
                continue  # in the daemon's namespace only: not a container's process
            namespace = pid_namespace(entry, proc=self._proc)
            index.setdefault(pids[-1], []).append((namespace, int(entry)))
        return index


def _choose(candidates: list[tuple[str, int]], record: ProcessRecord) -> int | None | Ambiguous:
    """The candidate in the record's namespace; by start time where the link was unreadable.

    Pods of one job on one node run the same pids and start within a second, so the
    start time must match to the clock tick, and two processes that still match are
    :data:`AMBIGUOUS` rather than a guess.
    """
    for namespace, host_pid in candidates:
        if namespace == record.pid_namespace:
            return host_pid
    matches = [
        host_pid
        for namespace, host_pid in candidates
        if not namespace and _started_at(host_pid, record.create_time)
    ]
    if len(matches) > 1:
        return AMBIGUOUS
    return matches[0] if matches else None


def _started_at(pid: int, create_time: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - create_time) <= CREATE_TIME_TOLERANCE_SECONDS
    except psutil.Error:
        return False


class Ambiguous:
    """Several processes match a record: it is neither followed nor reported down."""


AMBIGUOUS = Ambiguous()


def _key(record: ProcessRecord) -> _Key:
    return (record.pid_namespace, record.pid, record.create_time)


def _nspids(status: Path) -> list[int]:
    """The ``NSpid:`` line of a status file: the pid in each namespace, outermost first."""
    try:
        text = status.read_text()
    except OSError:  # exited meanwhile
        return []
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            fields = line.split()[1:]
            return [int(field) for field in fields] if all(f.isdigit() for f in fields) else []
    return []
