"""The exporter's HTTP server: one thread per request, bounded connections, quiet handlers.

Imported when an exporter starts serving, never at ``import stabmon.monitor``
(tests/test_layers.py checks it).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from stabmon.export.limits import BACKLOG, MAX_CONNECTIONS, MIN_REQUEST_SECONDS, REQUEST_SECONDS

__all__ = ["ThreadingServer", "bind"]


def bind(address: str, port: int, app: Any) -> ThreadingServer:
    """A server for the WSGI ``app`` bound to ``address``:``port`` (IPv6 when it has a colon)."""
    server_class = _ThreadingServerV6 if ":" in address else ThreadingServer
    server = make_server(address, port, app, server_class=server_class, handler_class=_QuietHandler)
    return server


class ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request, at most ``max_connections`` at once, each with a deadline.

    At the cap, ``get_request`` does not accept: the connection waits in the
    kernel's backlog, so a flood costs no Python work. ``service_actions`` runs
    every poll of the serving loop and shuts down the socket of any request
    older than ``request_seconds``, which ends its blocked read.
    """

    daemon_threads = True
    request_queue_size = BACKLOG
    #: Set under TLS: a client's handshake runs in its own request thread.
    tls: ssl.SSLContext | None = None
    request_seconds = REQUEST_SECONDS
    min_request_seconds = MIN_REQUEST_SECONDS

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._open: dict[socket.socket, float] = {}
        self._open_lock = threading.Lock()
        super().server_activate()

    def limit(
        self, max_connections: int, request_seconds: float, min_request_seconds: float
    ) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.request_seconds = request_seconds
        self.min_request_seconds = min_request_seconds

    def get_request(self) -> tuple[socket.socket, Any]:
        if not self._slots.acquire(timeout=0.05):
            raise OSError("every connection slot is busy")  # socketserver skips this round
        try:
            connection, address = super().get_request()
            if self.tls is not None:
                connection = self.tls.wrap_socket(
                    connection, server_side=True, do_handshake_on_connect=False
                )
        except BaseException:
            self._slots.release()
            raise
        with self._open_lock:
            self._open[connection] = time.monotonic()
        return connection, address

    def service_actions(self) -> None:
        cutoff = time.monotonic() - self.request_seconds
        with self._open_lock:
            late = [connection for connection, start in self._open.items() if start < cutoff]
        for connection in late:
            try:
                connection.shutdown(socket.SHUT_RDWR)  # the handler's read returns; it ends
            except OSError:
                pass

    def shutdown_request(self, request: Any) -> None:
        try:
            super().shutdown_request(request)
        finally:
            with self._open_lock:
                accepted = self._open.pop(request, None)
            if accepted is not None:
                # Pace: the slot frees no sooner than min_request_seconds after accept. This
                # thread sleeps without the GIL; a flood then costs training a bounded rate.
                rest = accepted + self.min_request_seconds - time.monotonic()
                if rest > 0:
                    time.sleep(rest)
                self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a failed handshake or a vanished client: no traceback on the user's stderr


class _ThreadingServerV6(ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: Prometheus scrapes every few seconds for days."""

    #: A connection that sends nothing is dropped after this long (its thread with it).
    timeout = 30.0

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

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass
