"""Which ranks ``stabmon status`` scrapes from the run directory, and which it may trust.

Every user of the node can write under the run-directory root, and a record outlives its
process: a rank killed by SIGKILL or the OOM killer leaves its record, naming a port that
any local user may bind next. So a target is a *record*, never a bare URL:

- records are read with trust by owner (:func:`stabmon.shared.rundir.read_owned_records`:
  a run belongs to the uid that owns its directory, each user's records bounded apart);
- only the caller's own runs are listed unless ``everyone`` is asked for (``--all``);
- a record whose process is gone (its pid absent, or now another program's: the start
  time differs) is not scraped at all, whatever answers at its port now;
- the operator's credentials go to a record's URL only when :func:`may_authenticate`:
  the record is the caller's own, its process is alive with the recorded start time, and
  that very process holds a socket listening on the URL's port, at an address of this
  node (``/proc/<pid>/fd`` and ``/proc/net/tcp{,6}``, through psutil). A port the process
  does not hold may be anyone's.
"""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
from pathlib import Path
from typing import NamedTuple

import psutil

from stabmon.shared.rundir import (
    OwnedRecord,
    ProcessRecord,
    boot_id,
    read_owned_records,
    run_directory_name,
)

__all__ = ["RegisteredTarget", "Registered", "may_authenticate", "process_alive", "registered"]

#: psutil derives create_time from boot time and clock ticks; allow for their rounding.
_CREATE_TIME_TOLERANCE_SECONDS = 0.5
_WILDCARDS = ("0.0.0.0", "::")


class RegisteredTarget(NamedTuple):
    """A registered rank: its metrics URL, the uid owning its record, its run and rank.

    ``pid`` and ``create_time`` name its process; ``alive`` says whether that process was
    running (with that start time) when the records were read.
    """

    url: str
    owner_uid: int
    run: str
    rank: str
    pid: int = 0
    create_time: float = 0.0
    alive: bool = True


class Registered(NamedTuple):
    """The targets listed, and how many ranks of other users' runs were left out."""

    targets: list[RegisteredTarget]
    others: int


def registered(
    root: Path, run: str | None = None, *, everyone: bool = False, uid: int | None = None
) -> Registered:
    """The ranks registered under ``root`` (a run-directory root, or one run's directory).

    Only the records of ``uid`` (default: this process's effective uid) unless
    ``everyone``. Records of processes that exited, or from another boot, are left out;
    those of processes that vanished (killed, crashed) are kept with ``alive`` False. Live
    processes come first, then by run and rank.
    """
    mine = os.geteuid() if uid is None else uid
    records, _ = read_owned_records(root)
    if not records and any(root.glob("rank-*.json")):  # ``root`` is one run's directory
        records = [r for r in read_owned_records(root.parent)[0] if _in_directory(r, root)]
    this_boot = boot_id()
    targets: list[RegisteredTarget] = []
    others = 0
    for owned in records:
        record = owned.record
        if run is not None and record.run != run:
            continue
        if record.exited_unix is not None or not record.metrics_url:
            continue
        if record.boot_id and this_boot and record.boot_id != this_boot:
            continue  # from before a reboot: nothing serves there any more
        if owned.owner_uid != mine and not everyone:
            others += 1
            continue
        targets.append(
            RegisteredTarget(
                record.metrics_url,
                owned.owner_uid,
                record.run,
                str(record.rank),
                record.pid,
                record.create_time,
                process_alive(record),
            )  # fmt: skip
        )
    targets.sort(key=lambda t: (not t.alive, t.run, int(t.rank) if t.rank.isdigit() else 0))
    return Registered(targets, others)


def process_alive(record: ProcessRecord) -> bool:
    """Whether ``record.pid`` runs, with the record's start time, and is no zombie."""
    try:
        process = psutil.Process(record.pid)
        with process.oneshot():
            if abs(process.create_time() - record.create_time) > _CREATE_TIME_TOLERANCE_SECONDS:
                return False  # the pid now names another program
            return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError):
        return True  # exists, but may not be read (hidepid): alive, though never trusted


def may_authenticate(target: RegisteredTarget, *, uid: int | None = None) -> bool:
    """Whether the operator's credentials may go to ``target.url``.

    The record must be ``uid``'s own (default: this process's effective uid), its process
    alive with the recorded start time and run by ``uid``, and that process must hold a
    socket listening on the URL's port at the URL's address: a loopback or literal
    address of this node (a host name is not resolved: no credentials). Anything less,
    and the port may belong to whoever bound it after the rank died.
    """
    mine = os.geteuid() if uid is None else uid
    if target.owner_uid != mine or not target.alive:
        return False
    parts = urllib.parse.urlsplit(target.url)
    try:
        port = parts.port
    except ValueError:
        return False
    address = _address(parts.hostname)
    if port is None or address is None:
        return False
    try:
        process = psutil.Process(target.pid)
        with process.oneshot():
            if abs(process.create_time() - target.create_time) > _CREATE_TIME_TOLERANCE_SECONDS:
                return False
            if process.uids().real != mine:
                return False
            connections = process.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return False
    for connection in connections:
        if connection.status != psutil.CONN_LISTEN or not connection.laddr:
            continue
        listening = _normalized(connection.laddr.ip)
        if connection.laddr.port != port:
            continue
        if listening == address or (listening in _WILDCARDS and _is_local(address)):
            return True
    return False


def _address(host: str | None) -> str | None:
    """The IP address a URL's host names, without DNS: a literal, or ``localhost``."""
    if host is None:
        return None
    if host.lower() == "localhost":
        return "127.0.0.1"
    try:
        return _normalized(host)
    except ValueError:
        return None


def _normalized(text: str) -> str:
    address = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def _is_local(address: str) -> bool:
    """Whether ``address`` is loopback or one of this node's interface addresses."""
    if ipaddress.ip_address(address).is_loopback:
        return True
    try:
        interfaces = psutil.net_if_addrs()
    except (psutil.Error, OSError):
        return False
    for entries in interfaces.values():
        for entry in entries:
            try:
                if _normalized(entry.address) == address:
                    return True
            except ValueError:
                continue
    return False


def _in_directory(owned: OwnedRecord, directory: Path) -> bool:
    return run_directory_name(owned.record.run) == directory.name
