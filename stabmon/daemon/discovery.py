"""Prometheus HTTP service discovery of this node's training exporters (``GET /targets``).

Every rank serves its own exporter (port ``9400 + LOCAL_RANK`` by default, or
the next free one), so which ports a node uses depends on how many ranks run
there and which ports were busy. The daemon already reads every rank's
registration record, which names the port it really got; serving that list in
Prometheus' ``http_sd_configs`` format makes one scrape config per node enough:
Prometheus asks the daemon which targets exist and scrapes each rank itself.
A rank that crashes drops out at the next poll; the rank that replaces it
registers its own port and appears.

Targets are addressed with the host name Prometheus used to reach the daemon
(the request's ``Host`` header): training processes run on the daemon's node,
so that name reaches them too, from the host itself (``localhost``), from a
container (``host.docker.internal``) or from another machine (the node's name).
Without a usable ``Host`` header, the node's own host name is used.

A record is written by whoever can write the run directory, so nothing of its
URL but the port is used, and only a port the daemon verified as a listening
socket of the process's own user (:mod:`stabmon.daemon.trust`); the host and
path never come from a record (Prometheus must not be sent to
169.254.169.254 because a file said so).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from stabmon.daemon.processes import ProcessSample

__all__ = ["CONTENT_TYPE", "PATH", "target_groups", "targets_response"]

PATH = "/targets"
CONTENT_TYPE = "application/json"
#: RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*"
)
_MAX_HOST_HEADER = 300


def target_groups(samples: Sequence[ProcessSample], host: str | None) -> list[dict[str, Any]]:
    """One target group per live process with a verified exporter port, in HTTP SD format.

    ``host`` is where Prometheus reaches this node; ``None`` means the node's
    own host name. The ``__meta_stabmon_*`` labels are there for relabelling;
    they are dropped before ingestion, and the series carry ``run`` and ``rank``.
    """
    target_host = host or _node_host()
    if ":" in target_host:
        target_host = f"[{target_host}]"
    groups: list[dict[str, Any]] = []
    for sample in sorted(samples, key=lambda s: (s.record.run, s.record.rank)):
        record = sample.record
        if not sample.alive or sample.target_port is None:
            continue
        labels = {
            "__meta_stabmon_run": record.run,
            "__meta_stabmon_rank": str(record.rank),
            "__meta_stabmon_local_rank": str(record.local_rank),
            "__meta_stabmon_pid": str(record.pid),
        }
        groups.append({"targets": [f"{target_host}:{sample.target_port}"], "labels": labels})
    return groups


def _node_host() -> str:
    name = socket.gethostname().lower()
    return name if _HOSTNAME.fullmatch(name) else "localhost"


def targets_response(
    samples: Sequence[ProcessSample], environ: Mapping[str, Any]
) -> tuple[str, bytes]:
    """The ``/targets`` body for a WSGI request: targets on the host the request addressed."""
    return CONTENT_TYPE, json.dumps(target_groups(samples, _request_host(environ))).encode()


def _request_host(environ: Mapping[str, Any]) -> str | None:
    """The host part of the request's ``Host`` header (``node1:9399`` -> ``node1``).

    Only a host name or an IP address is taken; anything else (a malformed or
    oversized header) falls back to each process's own address.
    """
    header = str(environ.get("HTTP_HOST") or "").strip()
    if not header or len(header) > _MAX_HOST_HEADER:
        return None
    try:
        host = urllib.parse.urlsplit(f"//{header}").hostname
    except ValueError:  # "[::1" and other broken brackets
        return None
    if not host:
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host if _HOSTNAME.fullmatch(host) else None
    return host
