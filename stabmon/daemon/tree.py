"""The node's process tree, read once per poll: which processes descend from which.

psutil's ``Process.children(recursive=True)`` reads the parent of every process on
the node each time it is called. The daemon wants the descendants (DataLoader
workers) of every rank it follows, so asking psutil once per rank made a poll cost
ranks × processes reads. :class:`ProcessTree` reads each process's parent once, when
first asked, and answers every rank of the poll from that reading.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

__all__ = ["ProcessTree"]

#: /proc/<pid>/stat is one line: pid, the command in parentheses (at most 16 bytes, which may
#: hold spaces and parentheses of its own), then numbers; well under this.
_MAX_STAT_BYTES = 4096


class ProcessTree:
    """Children by parent, from one reading of ``/proc``; make one per poll.

    A process that starts or exits after the reading is missed or skipped until the
    next poll, as it would be between two of psutil's readings.
    """

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._children: dict[int, list[int]] | None = None
        #: Processes whose parent could not be read (``hidepid``, another user's process to
        #: a daemon without access): their descendants are not found.
        self.unreadable = 0

    def descendants(self, process: psutil.Process) -> list[psutil.Process]:
        """What ``process.children(recursive=True)`` answers, from this poll's reading.

        As in psutil, a descendant that started before ``process`` is a reused pid, not a
        descendant: it and whatever hangs below it are left out. So is a pid whose parent
        is no longer the one read: it exited and its pid was reused since the reading.
        """
        children = self._children_by_parent()
        started = process.create_time()
        found: list[psutil.Process] = []
        seen: set[int] = set()
        stack = [process.pid]
        while stack:
            pid = stack.pop()
            if pid in seen:  # pids reused during the reading can make a cycle
                continue
            seen.add(pid)
            for child_pid in children.get(pid, ()):
                try:
                    child = psutil.Process(child_pid)
                    if child.create_time() < started or child.ppid() != pid:
                        continue
                except psutil.NoSuchProcess:
                    continue  # exited since the reading
                except psutil.AccessDenied:
                    self.unreadable += 1
                    continue
                found.append(child)
                stack.append(child_pid)
        return found

    def _children_by_parent(self) -> dict[int, list[int]]:
        if self._children is None:
            self._children = {}
            parents, self.unreadable = _parents(self._proc)
            for pid, parent in parents:
                self._children.setdefault(parent, []).append(pid)
        return self._children


def _parents(proc: Path) -> tuple[list[tuple[int, int]], int]:
    """(pid, parent pid) of every process in ``proc``, and how many could not be read.

    One that exits meanwhile is skipped, not counted.
    """
    try:
        names = os.listdir(proc)
    except OSError:
        return [], 0
    found = []
    unreadable = 0
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(proc / name / "stat", "rb") as stat:
                line = stat.read(_MAX_STAT_BYTES)
            fields = line[line.rfind(b")") + 2 :].split()
            found.append((int(name), int(fields[1])))
        except (FileNotFoundError, ProcessLookupError):
            continue
        except (OSError, IndexError, ValueError):
            unreadable += 1
    return found, unreadable
