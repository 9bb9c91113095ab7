"""The exporter's HTTP server: one thread per request, bounded connections, quiet handlers.

Anyone who can reach the port can connect, and some clients never send a byte. So:

- every connection is accepted at once, and refused (closed, with a ``503`` when it can be
  said without waiting) when ``max_connections + pending`` are already open: a flood is
  turned away rather than queued. Refusals cost the serving thread CPU it shares with
  training, so at most ``REFUSALS_PER_SECOND`` are made; beyond, connections wait in the
  listen backlog (``BACKLOG``) for a place or a refusal, and the kernel drops the rest;
- a connection that has not sent its whole request (line and headers) within
  ``request_line_seconds`` (1 s) of its accept is closed, and every request ends
  ``request_seconds`` after its accept, however slowly its client trickles;
- at most ``max_connections`` requests are served at once, each slot held at least
  ``min_request_seconds`` (the pace a flood can cost training), and one slot is kept for a
  *known scraper*: a request with the right basic-auth credentials, or, without basic
  auth, one from an address that was answered ``200`` at ``/metrics`` in the last ten
  minutes, not back to back (its last two answers at least ``KNOWN_GAP_SECONDS`` apart),
  and has no other connection open: Prometheus scrapes a target one request at a time,
  every few seconds; a flood does neither. A known scraper's connection is also let in
  when only the last open place is left, and it is served before the others that wait.
  On one address (loopback) a flooder that paces itself like Prometheus cannot be told
  from it without basic auth: set ``basic_auth_file`` where that matters.

Imported when an exporter starts serving, never at ``import stabmon.monitor``
(tests/test_layers.py checks it).
"""

from __future__ import annotations

import hmac
import socket
import ssl
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from stabmon.export.limits import (
    BACKLOG,
    MAX_CONNECTIONS,
    MIN_REQUEST_SECONDS,
    PENDING,
    REFUSALS_PER_SECOND,
    REQUEST_LINE_SECONDS,
    REQUEST_SECONDS,
)

__all__ = ["KNOWN_GAP_SECONDS", "KNOWN_SECONDS", "ThreadingServer", "bind"]

#: How long an address stays a known scraper after it was last answered at /metrics.
KNOWN_SECONDS = 600.0
#: An address answered more often than this is a flood, not a scraper.
KNOWN_GAP_SECONDS = 0.5
#: Known addresses remembered at most (the oldest is forgotten first).
_MAX_KNOWN = 64
_REFUSAL = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def bind(address: str, port: int, app: Any) -> ThreadingServer:
    """A server for the WSGI ``app`` bound to ``address``:``port`` (IPv6 when it has a colon)."""
    server_class = _ThreadingServerV6 if ":" in address else ThreadingServer
    server = make_server(address, port, app, server_class=server_class, handler_class=_QuietHandler)
    return server


@dataclass
class _Connection:
    accepted: float
    host: str
    request_read: bool = False
    serving: bool = False


class ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per connection, a bounded number open, each with deadlines (module doc)."""

    daemon_threads = True
    request_queue_size = BACKLOG
    #: Set under TLS: a client's handshake runs in its own request thread.
    tls: ssl.SSLContext | None = None
    #: The ``Authorization`` header a known scraper sends, when basic auth is on.
    authorization: bytes | None = None
    request_seconds = REQUEST_SECONDS
    min_request_seconds = MIN_REQUEST_SECONDS
    request_line_seconds = REQUEST_LINE_SECONDS
    pending = PENDING
    max_connections = MAX_CONNECTIONS

    def server_activate(self) -> None:
        self._open: dict[Any, _Connection] = {}
        self._serving = 0
        self._waiting_known = 0
        self._changed = threading.Condition()
        #: Address -> (when it was last answered at /metrics, the gap to the answer before).
        self._known: OrderedDict[str, tuple[float, float]] = OrderedDict()
        #: Connections refused because every place was taken (read by tests and benches).
        self.refused = 0
        self._tokens = 1.0
        self._refilled = time.monotonic()
        super().server_activate()

    def limit(
        self,
        max_connections: int,
        request_seconds: float,
        min_request_seconds: float,
        *,
        request_line_seconds: float = REQUEST_LINE_SECONDS,
        pending: int = PENDING,
    ) -> None:
        self.max_connections = max_connections
        self.request_seconds = request_seconds
        self.min_request_seconds = min_request_seconds
        self.request_line_seconds = request_line_seconds
        self.pending = pending

    def get_request(self) -> tuple[socket.socket, Any]:
        with self._changed:
            if not self._may_accept():
                self._changed.wait(0.02)  # a place may free; else leave it to the backlog
                if not self._may_accept():
                    raise OSError("every place is taken")  # socketserver skips this round
        connection, address = super().get_request()
        if self.tls is not None:
            try:
                connection = self.tls.wrap_socket(
                    connection, server_side=True, do_handshake_on_connect=False
                )
            except BaseException:
                connection.close()
                raise
        return connection, address

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Admit a connection while places are left (the last one for a known scraper)."""
        host = str(client_address[0]) if isinstance(client_address, tuple) else ""
        now = time.monotonic()
        with self._changed:
            places = self.max_connections + self.pending
            alone = not any(state.host == host for state in self._open.values())
            reserved = 0 if alone and self._is_known(host, now) else 1
            if len(self._open) >= places - reserved:
                self.refused += 1
                self._tokens -= 1.0
                admitted = False
            else:
                self._open[request] = _Connection(now, host)
                admitted = True
        if not admitted and self.tls is None:
            try:  # said without waiting, or not at all: the connection is closed either way
                request.setblocking(False)
                request.send(_REFUSAL)
            except OSError:
                pass
        return admitted

    def serve(self, request: Any, authorization: str | None) -> bool:
        """Called by the handler once the request is read: wait for a serving slot.

        False when none came before the request's deadline (the connection is closed).
        """
        with self._changed:
            state = self._open.get(request)
            if state is None:
                return False
            state.request_read = True
            known = self._is_priority(state, authorization)
            deadline = state.accepted + self.request_seconds
            self._waiting_known += known
            try:
                while True:
                    # One slot is kept for a known scraper; others wait for it to go first.
                    others = max(self.max_connections - 1, 1)
                    free = self._serving < (self.max_connections if known else others)
                    if free and (known or not self._waiting_known):
                        self._serving += 1
                        state.serving = True
                        return True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._changed.wait(min(left, 0.1))
            finally:
                self._waiting_known -= known

    def answered(self, request: Any, path: str, code: str) -> None:
        """A response was sent: a 200 at /metrics makes its address a known scraper."""
        if code != "200" or path != "/metrics":
            return
        with self._changed:
            state = self._open.get(request)
            if state is None or not state.host:
                return
            now = time.monotonic()
            last = self._known.get(state.host)
            self._known[state.host] = (now, now - last[0] if last else KNOWN_SECONDS)
            self._known.move_to_end(state.host)
            while len(self._known) > _MAX_KNOWN:
                self._known.popitem(last=False)

    def _may_accept(self) -> bool:
        """Whether a connection taken now will be admitted (the place kept for a known
        scraper aside), or may be refused within the refusal rate. ``_changed`` is held."""
        if len(self._open) < self.max_connections + self.pending - 1:
            return True
        now = time.monotonic()
        self._tokens = min(
            self._tokens + (now - self._refilled) * REFUSALS_PER_SECOND,
            max(REFUSALS_PER_SECOND / 10, 1.0),
        )
        self._refilled = now
        return self._tokens >= 1.0

    def _is_known(self, host: str, now: float) -> bool:
        seen = self._known.get(host)
        return seen is not None and now - seen[0] < KNOWN_SECONDS and seen[1] >= KNOWN_GAP_SECONDS

    def _is_priority(self, state: _Connection, authorization: str | None) -> bool:
        if self.authorization is not None:  # basic auth on: only the credentials tell
            sent = (authorization or "").encode("latin-1", "replace")
            return hmac.compare_digest(sent, self.authorization)
        if not self._is_known(state.host, time.monotonic()):
            return False
        # Prometheus keeps one scrape of a target at a time; a flood from its address does not.
        return sum(1 for other in self._open.values() if other.host == state.host) == 1

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._changed:
            late = [
                connection
                for connection, state in self._open.items()
                if now - state.accepted > self.request_seconds
                or (not state.request_read and now - state.accepted > self.request_line_seconds)
            ]
        for connection in late:
            try:
                connection.shutdown(socket.SHUT_RDWR)  # the handler's read returns; it ends
            except OSError:
                pass

    def shutdown_request(self, request: Any) -> None:
        try:
            super().shutdown_request(request)
        finally:
            with self._changed:
                state = self._open.pop(request, None)
                self._changed.notify_all()
            if state is not None and state.serving:
                # Pace: the slot frees no sooner than min_request_seconds after accept. This
                # thread sleeps without the GIL; a flood then costs training a bounded rate.
                rest = state.accepted + self.min_request_seconds - time.monotonic()
                if rest > 0:
                    time.sleep(rest)
                with self._changed:
                    self._serving -= 1
                    self._changed.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a failed handshake or a vanished client: no traceback on the user's stderr


class _ThreadingServerV6(ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: Prometheus scrapes every few seconds for days."""

    #: A read that waits this long ends the connection (the server's deadlines come first).
    timeout = 30.0
    server: ThreadingServer

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(self.timeout)
            self.request.do_handshake()  # here, in the request thread, not in accept()
        super().setup()

    def handle(self) -> None:
        try:
            super().handle()
        except (OSError, ssl.SSLError):
            pass  # a client that went away, or spoke plain HTTP to HTTPS: nothing to serve

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        return self.server.serve(self.request, self.headers.get("Authorization"))

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        path = self.path.split("?", 1)[0] if isinstance(self.path, str) else ""
        self.server.answered(self.request, path, str(code))

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass
