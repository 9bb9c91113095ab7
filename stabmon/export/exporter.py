"""The HTTP endpoint Prometheus scrapes: one per Monitor, in a daemon thread.

A busy port never reaches training: the exporter tries the configured port,
then further candidates, and in the worst case the monitor runs on without an
endpoint (the event log still records everything). ``stop`` shuts the server
down and frees the port, so ``detach`` leaves nothing listening.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from stabmon.log import LogLimiter

__all__ = ["Exporter", "Route", "candidate_ports"]

#: An extra path's handler: the WSGI environ in, (content type, body) out.
Route = Callable[[Mapping[str, Any]], tuple[str, bytes]]
_StartResponse = Callable[..., Any]


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


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request, so a slow scraper never holds up the next one."""

    daemon_threads = True


class _ThreadingServerV6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: Prometheus scrapes every few seconds for days."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


class Exporter:
    """Serves one registry at ``/metrics`` on the first free port of ``ports``.

    Only ``/metrics`` and the paths in ``routes`` answer (``GET`` and ``HEAD``);
    every other path is a 404, and no request body is ever read.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        address: str,
        ports: Sequence[int],
        limiter: LogLimiter,
        routes: Mapping[str, Route] | None = None,
    ) -> None:
        self._registry = registry
        self._metrics_app = make_wsgi_app(registry)
        self._routes = dict(routes or {})
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
                server = self._bind(port)
            except OSError as error:
                failures.append(f"{port}: {error.strerror or error}")
                continue
            thread = threading.Thread(
                target=server.serve_forever, name="stabmon-exporter", daemon=True
            )
            thread.start()
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

    def _bind(self, port: int) -> WSGIServer:
        server_class = _ThreadingServerV6 if ":" in self._address else _ThreadingServer
        return make_server(
            self._address, port, self._serve, server_class=server_class, handler_class=_QuietHandler
        )

    def _serve(self, environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        """The WSGI application: ``/metrics``, the extra routes, and 404 for the rest."""
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "")
        if method not in ("GET", "HEAD"):
            return _plain(start_response, "405 Method Not Allowed", b"GET or HEAD only\n")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)  # type: ignore[no-any-return]
        route = self._routes.get(path)
        if route is None:
            known = ", ".join(["/metrics", *self._routes])
            return _plain(start_response, "404 Not Found", f"not found; try {known}\n".encode())
        content_type, body = route(environ)
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        start_response("200 OK", headers)
        return [b"" if method == "HEAD" else body]

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


def _plain(start_response: _StartResponse, status: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
    return [body]
