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
"""

from __future__ import annotations

import ipaddress
import json
import re
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
    """One target group per live process with an exporter, in Prometheus' HTTP SD format.

    ``host`` replaces the host of each process's own metrics URL (which names the
    address it bound, often ``127.0.0.1``); ``None`` keeps it. The ``__meta_stabmon_*``
    labels are there for relabelling; they are dropped before ingestion, and the
    series already carry ``run`` and ``rank`` themselves.
    """
    groups: list[dict[str, Any]] = []
    for sample in sorted(samples, key=lambda s: (s.record.run, s.record.rank)):
        record = sample.record
        if not sample.alive or not record.metrics_url:
            continue
        url = urllib.parse.urlsplit(record.metrics_url)
        if url.port is None:
            continue
        target_host = host or url.hostname or "localhost"
        if ":" in target_host:
            target_host = f"[{target_host}]"
        labels = {
            "__meta_stabmon_run": record.run,
            "__meta_stabmon_rank": str(record.rank),
            "__meta_stabmon_local_rank": str(record.local_rank),
            "__meta_stabmon_pid": str(record.pid),
        }
        if url.path and url.path != "/metrics":
            labels["__metrics_path__"] = url.path
        groups.append({"targets": [f"{target_host}:{url.port}"], "labels": labels})
    return groups


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
