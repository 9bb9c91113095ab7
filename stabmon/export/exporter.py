"""The HTTP endpoint Prometheus scrapes: one per Monitor, in a daemon thread.

A busy port never reaches training: the exporter tries the configured port,
then further candidates, and in the worst case the monitor runs on without an
endpoint (the event log still records everything). ``stop`` shuts the server
down and frees the port, so ``detach`` leaves nothing listening.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from stabmon.log import LogLimiter

__all__ = ["Exporter", "candidate_ports"]


def candidate_ports(base: int, local_rank: int, local_world_size: int, attempts: int) -> list[int]:
    """Ports to try, in order: ``base + local_rank``, then steps of the local world size.

    Stepping by the local world size keeps a rank's fallback off its siblings'
    own ports. ``base == 0`` asks the OS for any free port.
    """
    if base == 0:
        return [0]
    first = base + local_rank
    return [
        port for port in (first + k * local_world_size for k in range(attempts)) if port < 65536
    ]


class Exporter:
    """Serves one registry over HTTP on the first free port of ``ports``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        address: str,
        ports: Sequence[int],
        limiter: LogLimiter,
    ) -> None:
        self._registry = registry
        self._address = address
        self._ports = list(ports)
        self._limiter = limiter
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def start(self) -> bool:
        """Bind the first free candidate port; False (logged) when none could be bound."""
        failures: list[str] = []
        for port in self._ports:
            try:
                server, thread = start_http_server(
                    port, addr=self._address, registry=self._registry
                )
            except OSError as error:
                failures.append(f"{port}: {error.strerror or error}")
                continue
            self._server, self._thread = server, thread
            self.port = int(server.server_address[1])
            if failures:
                self._limiter.once(
                    "exporter:fallback",
                    logging.WARNING,
                    "stabmon: exporter port(s) busy (%s); serving metrics on %s instead",
                    "; ".join(failures),
                    self.url,
                )
            return True
        self._limiter.once(
            "exporter:none",
            logging.WARNING,
            "stabmon: could not bind the metrics exporter on %s (%s); training goes on without "
            "an HTTP endpoint and the event log still records everything. Set `port` to a free "
            "port, or `port: 0` for any.",
            self._address,
            "; ".join(failures) or "no candidate ports",
        )
        return False

    @property
    def url(self) -> str | None:
        """The scrape URL, with a loopback host when bound to every interface."""
        if self.port is None:
            return None
        host = self._address
        if host in ("", "0.0.0.0"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and free the port; returns within about a second."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(1.0)
            self._thread = None
        self.port = None
