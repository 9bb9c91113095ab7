"""``GET /healthz``: the daemon's health check for probes that carry no credentials.

Kubernetes' httpGet probes cannot send basic auth, so once ``basic_auth_file`` is set
a probe of ``/metrics`` gets 401 and the kubelet restarts the daemon forever. This
path answers without authentication (over TLS when TLS is on), and so says nothing
at all: no version, no node, no GPU, no run. It answers while the HTTP server
serves; a daemon whose pollers are stuck is ``StabmonDaemonDown``'s case, judged from
``stabmon_daemon_last_poll_timestamp_seconds``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["PATH", "healthz"]

PATH = "/healthz"


def healthz(environ: Mapping[str, Any]) -> tuple[str, bytes]:
    """The whole answer, whoever asks."""
    return "text/plain; charset=utf-8", b"ok\n"
