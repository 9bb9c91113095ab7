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
descriptors), each read bounded.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from stabmon.safefs import read_regular

__all__ = ["listening_sockets", "owner_may_speak_for", "record_port", "verified_port"]

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


def listening_sockets(pid: int, proc: Path = Path("/proc")) -> set[tuple[int, int]]:
    """(port, uid) of every listening TCP socket in the network namespace of ``pid``."""
    found: set[tuple[int, int]] = set()
    for table in ("tcp", "tcp6"):
        try:
            text = read_regular(proc / str(pid) / "net" / table, _MAX_TABLE_BYTES).decode("ascii")
        except (OSError, ValueError):
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
    return found


def verified_port(
    pid: int, uid: int, metrics_url: str | None, proc: Path = Path("/proc")
) -> int | None:
    """The record's port when ``pid``'s namespace has it listening as ``uid``; else None."""
    port = record_port(metrics_url)
    if port is None:
        return None
    return port if (port, uid) in listening_sockets(pid, proc) else None
