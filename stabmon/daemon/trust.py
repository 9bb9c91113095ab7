"""Which registration records the daemon believes, and which ports it advertises.

Every user of a node can write the run directory, so a record proves nothing
by itself. The daemon honours one only when:

- the record's file is owned by the uid that runs the process it names (the
  process wrote it, or its own user did), and the process's start time matches
  the record's (checked by :mod:`stabmon.daemon.processes`), and it is not the
  daemon itself;
- for ``/targets``, the port of its ``metrics_url`` is a TCP socket that the
  process's network namespace has listening, owned by that same uid. The host
  and path of the URL are never used: Prometheus is sent to this node, at
  ``/metrics``, or nowhere.

Listening sockets come from ``/proc/<pid>/net/tcp`` and ``tcp6`` (the
process's own network namespace; readable by any user, unlike its file
descriptors), each read bounded. The kernel writes out every socket of the
namespace on each read, connections included, and the ranks of a node mostly
share one namespace: :class:`ListeningSockets` reads each namespace's tables once
per poll, where the daemon may tell namespaces apart.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

from stabmon.shared.safefs import read_regular

__all__ = ["ListeningSockets", "owner_may_speak_for", "record_port"]

#: /proc/<pid>/net/tcp of a busy node is a few MB at most; more is not read.
_MAX_TABLE_BYTES = 16 * 2**20
_LISTEN = "0A"


def owner_may_speak_for(owner_uid: int, process_uid: int, pid: int) -> bool:
    """Whether a record file owned by ``owner_uid`` may describe ``pid``, run by ``process_uid``."""
    return owner_uid == process_uid


def record_port(metrics_url: str | None) -> int | None:
    """The port of a record's metrics URL, or None for no URL, no port or a malformed one."""
    if not metrics_url:
        return None
    try:
        port = urllib.parse.urlsplit(metrics_url).port
    except ValueError:  # port 99999, "abc", a broken IPv6 bracket
        return None
    return port if port is not None and 0 < port < 65536 else None


def _read_listening(pid: int, proc: Path) -> tuple[frozenset[tuple[int, int]], bool]:
    """The listening sockets of ``pid``'s namespace, and whether both tables were read."""
    found: set[tuple[int, int]] = set()
    complete = True
    for table in ("tcp", "tcp6"):
        try:
            text = read_regular(proc / str(pid) / "net" / table, _MAX_TABLE_BYTES).decode("ascii")
        except (OSError, ValueError):
            complete = False
            continue
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 8 or fields[3] != _LISTEN:
                continue
            try:
                port = int(fields[1].rpartition(":")[2], 16)
                uid = int(fields[7])
            except ValueError:
                continue
            found.add((port, uid))
    return frozenset(found), complete


class ListeningSockets:
    """The listening TCP sockets of each network namespace, read once: make one per poll.

    A namespace is known by its ``/proc/<pid>/ns/net`` link, which names the same
    namespace for every process in it. Reading that link needs ptrace access to the
    process (root, or the process's own user); without it the tables of that pid are
    read for it alone, as if it had a namespace of its own. Tables are shared only when
    the link names the same namespace after they were read as before, and both were
    read: a process that moved to a namespace of its own meanwhile (``unshare``), or
    exited, must not lend its tables to the ranks of the namespace it left.
    """

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._by_namespace: dict[str, frozenset[tuple[int, int]]] = {}

    def of(self, pid: int) -> frozenset[tuple[int, int]]:
        """(port, uid) of every listening TCP socket in the network namespace of ``pid``."""
        namespace = self._namespace(pid)
        if namespace is not None and namespace in self._by_namespace:
            return self._by_namespace[namespace]
        found, complete = _read_listening(pid, self._proc)
        if namespace is not None and complete and self._namespace(pid) == namespace:
            self._by_namespace[namespace] = found
        return found

    def _namespace(self, pid: int) -> str | None:
        try:
            return os.readlink(self._proc / str(pid) / "ns" / "net")
        except OSError:  # another user's process, or gone: its own read, not shared
            return None

    def verified_port(self, pid: int, uid: int, metrics_url: str | None) -> int | None:
        """The record's port when ``pid``'s namespace has it listening as ``uid``; else None."""
        port = record_port(metrics_url)
        if port is None:
            return None
        return port if (port, uid) in self.of(pid) else None
