"""The HTTP endpoint Prometheus scrapes: one per Monitor, in a daemon thread.

A busy port never reaches training: the exporter tries the configured port,
then further candidates, and in the worst case the monitor runs on without an
endpoint (the event log still records everything). ``stop`` shuts the server
down and frees the port, so ``detach`` leaves nothing listening.

Anyone who can reach the port can scrape it, so serving is bounded
(:mod:`stabmon.export.http_server`): a connection must send its request within a
second, at most ``max_connections`` requests are served at once (one slot kept for
a scraper that has been answered, such as Prometheus), a few more wait, the rest are
refused at once rather than queued; each slot is held at least
``min_request_seconds`` (so at most 16 requests a second are served by default),
each request ends within ``request_seconds`` from accept to last byte however
slowly the client trickles, and the scrape body is
built at most once per ``cache_seconds`` (a flood of scrapes costs training
one body per interval, not one per request). Building it is contained family
by family: a family that fails to collect or encode is left out, counted in
``stabmon_internal_errors_total{component="exporter"}`` and logged once; the
rest are served.

TLS and HTTP basic auth are optional (:class:`Security`). Both fail closed: a
certificate or credentials file that cannot be read means no endpoint at all
(one log line), never a plain or unauthenticated one. The TLS handshake runs in
the request's own thread, so a client that connects and says nothing cannot
hold up the next scrape.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from stabmon.export.limits import (
    BACKLOG,
    MAX_CONNECTIONS,
    MIN_REQUEST_SECONDS,
    REQUEST_SECONDS,
)
from stabmon.export.security import Security
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter
from stabmon.shared.threads import start_without_signals

if TYPE_CHECKING:
    from stabmon.export.http_server import ThreadingServer

__all__ = [
    "BACKLOG",
    "MAX_CONNECTIONS",
    "MIN_REQUEST_SECONDS",
    "REQUEST_SECONDS",
    "Exporter",
    "Route",
    "Security",
    "address_note",
    "candidate_ports",
]

#: An extra path's handler: the WSGI environ in, (content type, body) out.
Route = Callable[[Mapping[str, Any]], tuple[str, bytes]]
_StartResponse = Callable[..., Any]


def address_note(address: str) -> str:
    """What binding ``address`` means, for the line that prints it (empty for one address).

    Every interface is the default so that a Prometheus on another host reaches the
    exporter; the price is that anyone who reaches the node may connect too.
    """
    if address in ("", "0.0.0.0", "::"):
        return (
            f" (bound to {address or '0.0.0.0'}, every interface: Prometheus on another host "
            "can scrape it, and so can anyone who reaches this node; set the address option "
            "to the one Prometheus uses to narrow it)"
        )
    return ""


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
    """Serves one registry at ``/metrics`` on the first free port of ``ports``.

    Only ``/metrics`` and the paths in ``routes`` answer (``GET`` and ``HEAD``);
    every other path is a 404, and no request body is ever read. With
    ``security``, it serves HTTPS and/or asks for basic auth (401 without it).
    A failure to serve at all is logged once and, with ``guard``, counted in
    ``stabmon_internal_errors_total{component="exporter"}``.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        address: str,
        ports: Sequence[int],
        limiter: LogLimiter,
        routes: Mapping[str, Route] | None = None,
        security: Security | None = None,
        guard: Guard | None = None,
        cache_seconds: float = 0.0,
        max_connections: int = MAX_CONNECTIONS,
        request_seconds: float = REQUEST_SECONDS,
        min_request_seconds: float = MIN_REQUEST_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        public_routes: Mapping[str, Route] | None = None,
    ) -> None:
        self._registry = registry
        # Paths that answer without basic auth (a health check for probes that carry no
        # credentials): they must reveal nothing, as anyone who can connect may read them.
        self._public_routes = dict(public_routes or {})
        self._cache_seconds = cache_seconds
        self._max_connections = max_connections
        self._request_seconds = request_seconds
        self._min_request_seconds = min_request_seconds
        self._clock = clock
        self._cached: tuple[float, bytes] | None = None
        self._body_lock = threading.Lock()
        self._security = security or Security()
        self._guard = guard
        self._tls: ssl.SSLContext | None = None
        self._authorization: bytes | None = None
        self._routes = dict(routes or {})
        self._address = address
        self._ports = list(ports)
        self._limiter = limiter
        self._server: ThreadingServer | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def start(self) -> bool:
        """Bind the first free candidate port; False (logged) when none could be bound."""
        try:
            self._tls = self._security.ssl_context()
            self._authorization = self._security.expected_authorization()
        except (OSError, ValueError, ssl.SSLError) as error:
            self._fail(
                "exporter:security",
                "stabmon: not serving metrics: %s; training goes on and the event log still "
                "records everything. Fix it, or remove it to serve plain HTTP.",
                self._security.problem() or f"TLS or basic-auth settings cannot be used: {error}",
            )
            return False
        failures: list[str] = []
        for port in self._ports:
            try:
                server = self._bind(port)
            except OSError as error:
                failures.append(f"{port}: {error.strerror or error}")
                continue
            # shutdown() waits for serve_forever's next poll: a short poll keeps detach() instant.
            thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name="stabmon-exporter",
                daemon=True,
            )
            start_without_signals(thread)
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
        self._fail(
            "exporter:none",
            "stabmon: could not bind the metrics exporter on %s (%s); training goes on without "
            "an HTTP endpoint and the event log still records everything. Set `port` to a free "
            "port, or `port: 0` for any.",
            self._address,
            "; ".join(failures) or "no candidate ports",
        )
        return False

    def _fail(self, key: str, message: str, *args: object) -> None:
        self._limiter.once(key, logging.WARNING, message, *args)
        if self._guard is not None:
            self._guard.count("exporter")

    def _bind(self, port: int) -> ThreadingServer:
        # Here, not at import: a training script that never serves loads no HTTP server.
        from stabmon.export.http_server import bind

        server = bind(self._address, port, self._serve)
        server.tls = self._tls
        server.authorization = self._authorization  # its sender is a known scraper
        server.limit(self._max_connections, self._request_seconds, self._min_request_seconds)
        return server

    def body(self) -> bytes:
        """The exposition of the registry, built at most once per ``cache_seconds``."""
        with self._body_lock:  # one builder at a time: concurrent scrapes share its result
            now = self._clock()
            cached = self._cached
            if cached is not None and now - cached[0] < self._cache_seconds:
                return cached[1]
            body = b"".join(self._families())
            self._cached = (now, body)
            return body

    def _families(self) -> Iterator[bytes]:
        """Each family's text; one that fails to collect or encode is left out and counted."""
        families = iter(self._registry.collect())
        while True:
            try:
                family = next(families)
            except StopIteration:
                return
            except Exception as error:  # a collector that raises: the rest of it is lost
                self._contained(error)
                return
            try:
                yield generate_latest(_One(family))
            except Exception as error:  # a name or label that cannot be encoded, say
                self._contained(error)

    def _contained(self, error: Exception) -> None:
        if self._guard is not None:
            self._guard.record("exporter", error)
        else:
            self._limiter.once(
                f"exporter:collect:{type(error).__name__}",
                logging.WARNING,
                "stabmon: left a metric family out of the scrape: %s: %.200s",
                type(error).__name__,
                error,
            )

    def _serve(self, environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        """The WSGI application: ``/metrics``, the extra routes, and 404 for the rest."""
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "")
        public = self._public_routes.get(path)
        if public is not None and method in ("GET", "HEAD"):
            content_type, body = public(environ)
            headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
            start_response("200 OK", headers)
            return [b"" if method == "HEAD" else body]
        if self._authorization is not None and not _authorized(environ, self._authorization):
            start_response(
                "401 Unauthorized",
                [
                    ("Content-Type", "text/plain; charset=utf-8"),
                    ("WWW-Authenticate", 'Basic realm="stabmon", charset="UTF-8"'),
                ],
            )
            return [b"basic auth required\n"]
        if method not in ("GET", "HEAD"):
            return _plain(start_response, "405 Method Not Allowed", b"GET or HEAD only\n")
        if path == "/metrics":
            body = self.body()
            headers = [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))]
            start_response("200 OK", headers)
            return [b"" if method == "HEAD" else body]
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
        scheme = "https" if self._tls is not None else "http"
        host = self._address
        if host in ("", "0.0.0.0"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{self.port}/metrics"

    def stop(self, timeout: float = 1.0) -> None:
        """Stop serving and free the port; waits at most ``timeout`` for the server thread.

        ``shutdown`` returns within one poll interval of ``serve_forever`` (requests are
        served in threads of their own, so none holds the loop).
        """
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(max(timeout, 0.0))
            self._thread = None
        self.port = None


class _One:
    """One family, shaped as the registry ``generate_latest`` takes."""

    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> list[Metric]:
        return [self._family]


def _plain(start_response: _StartResponse, status: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
    return [body]


def _authorized(environ: Mapping[str, Any], expected: bytes) -> bool:
    """Whether the request's ``Authorization`` header is ``expected`` (constant-time compare)."""
    sent = str(environ.get("HTTP_AUTHORIZATION", "")).encode("latin-1", "replace")
    scheme, _, token = sent.partition(b" ")
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return False
    given = b"Basic " + base64.b64encode(decoded)
    return scheme.lower() == b"basic" and hmac.compare_digest(given, expected)
