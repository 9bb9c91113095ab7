"""The exporter's HTTP server: bounded connections, deadlines, a slot kept for Prometheus.

Anyone who can reach the port can connect, and some clients never send a byte. So:

- the serving loop accepts every connection at once and keeps it at the door, in one
  selector, without a thread: at most ``MAX_WAITING`` (256) at a time (beyond, they wait in
  the kernel's listen backlog, ``BACKLOG``). A connection that has not started its request
  within ``request_line_seconds`` (1 s) of its accept is closed; idle connections cost a
  file descriptor for a second, no thread and no queue place;
- a connection that has sent bytes gets a thread and a *place* while fewer than
  ``max_connections + pending`` are taken; one that finds none within the same second is
  refused (a ``503`` when it can be said without waiting, then closed), never queued
  further. In its thread it must finish its request (line and headers) within that second
  too, and every request ends ``request_seconds`` after its accept, however slowly its
  client trickles;
- at most ``max_connections`` requests are served at once, each slot held at least
  ``min_request_seconds`` from when it was taken (the pace a flood can cost training), and
  one slot, and the last place, are kept for a *known scraper*, which also goes first
  through the door: a request with the right basic-auth credentials or, without basic
  auth, a connection from an address that was answered ``200`` at ``/metrics`` in the last
  ten minutes, not back to back (its last two answers at least ``KNOWN_GAP_SECONDS``
  apart), and has no other connection open: Prometheus scrapes a target one request at a
  time, every few seconds; a flood does neither. On one address (loopback) a flooder that
  paces itself like Prometheus cannot be told from it without basic auth: set
  ``basic_auth_file`` where that matters.

A process forked from one that serves (a DataLoader worker, with the default ``fork``)
would hold the listening socket and the door's connections as long as it lives: a port
that stays taken after the server closed, connections that never end. Right after a fork
the child closes its copies (``os.register_at_fork``); the parent's are untouched.

Imported when an exporter starts serving, never at ``import stabmon.monitor``
(tests/test_layers.py checks it).
"""

from __future__ import annotations

import hmac
import os
import selectors
import socket
import ssl
import threading
import time
import weakref
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
    REQUEST_LINE_SECONDS,
    REQUEST_SECONDS,
)

__all__ = ["KNOWN_GAP_SECONDS", "KNOWN_SECONDS", "MAX_WAITING", "ThreadingServer", "bind"]

#: Connections kept at the door (accepted, no thread yet) at most.
MAX_WAITING = 256

#: How long an address stays a known scraper after it was last answered at /metrics.
KNOWN_SECONDS = 600.0
#: An address answered more often than this is a flood, not a scraper.
KNOWN_GAP_SECONDS = 0.5
#: Known addresses remembered at most (the oldest is forgotten first).
_MAX_KNOWN = 64
_REFUSAL = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


#: Every server of this process, so that a forked child can close its copies of their sockets.
_SERVERS: weakref.WeakSet[ThreadingServer] = weakref.WeakSet()


def _close_in_forked_child() -> None:
    """In a child just forked: close its copies of every server's sockets (close, never
    shutdown, which would end the parent's too). The serving thread was not forked."""
    for server in list(_SERVERS):
        for connection in [*server._door, *server._open]:
            if isinstance(connection, socket.socket):
                ThreadingServer._close(connection)
        ThreadingServer._close(server.socket)


def bind(address: str, port: int, app: Any) -> ThreadingServer:
    """A server for the WSGI ``app`` bound to ``address``:``port`` (IPv6 when it has a colon)."""
    server_class = _ThreadingServerV6 if ":" in address else ThreadingServer
    server = make_server(address, port, app, server_class=server_class, handler_class=_QuietHandler)
    return server


@dataclass
class _Connection:
    accepted: float
    host: str
    address: Any = None
    #: At the door: whether it has sent anything yet.
    started: bool = False
    request_read: bool = False
    #: When it took a serving slot (None: it never did); the slot is paced from then.
    serving: float | None = None


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
        self._door: dict[socket.socket, _Connection] = {}
        self._serving = 0
        self._waiting_known = 0
        self._changed = threading.Condition()
        #: Address -> (when it was last answered at /metrics, the gap to the answer before).
        self._known: OrderedDict[str, tuple[float, float]] = OrderedDict()
        #: Connections refused because no place was free within a second (tests, benches).
        self.refused = 0
        self._halt = threading.Event()
        self._halted = threading.Event()
        self._halted.set()
        super().server_activate()
        self.socket.setblocking(False)
        _SERVERS.add(self)

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

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept, keep at the door, admit, and enforce deadlines until :meth:`shutdown`."""
        self._halted.clear()
        try:
            with selectors.DefaultSelector() as selector:
                listening = False
                while not self._halt.is_set():
                    if listening != (len(self._door) < MAX_WAITING):
                        if listening:
                            selector.unregister(self.socket)
                        else:
                            selector.register(self.socket, selectors.EVENT_READ)
                        listening = not listening
                    for key, _ in selector.select(min(poll_interval, 0.05)):
                        if key.fileobj is self.socket:
                            self._accept(selector)
                        else:
                            self._started(selector, key.fileobj)
                    self._admit(selector)
                    self.service_actions()
        finally:
            for connection in list(self._door):
                self._close(connection)
            self._door.clear()
            self._halt.clear()
            self._halted.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait until it has (from another thread)."""
        self._halt.set()
        self._halted.wait()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        while len(self._door) < MAX_WAITING:
            try:
                connection, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # a connection reset before it was taken, too many open files
            host = str(address[0]) if isinstance(address, tuple) else ""
            self._door[connection] = _Connection(now, host, address)
            selector.register(connection, selectors.EVENT_READ)

    def _started(self, selector: selectors.BaseSelector, connection: Any) -> None:
        selector.unregister(connection)  # readable: its request (or handshake) has begun
        state = self._door.get(connection)
        if state is not None:
            state.started = True

    def _admit(self, selector: selectors.BaseSelector) -> None:
        """Give started connections a thread while places are free, known scrapers first;
        close what waited at the door past ``request_line_seconds``."""
        now = time.monotonic()
        started = [(c, state) for c, state in self._door.items() if state.started]
        started.sort(key=lambda item: (not self._known_alone(item[1].host, now), item[1].accepted))
        for connection, state in started:
            with self._changed:
                places = self.max_connections + self.pending
                reserved = 0 if self._known_alone(state.host, now) else 1
                if len(self._open) >= places - reserved:
                    continue  # waits at the door, a second at most
                del self._door[connection]
                self._open[connection] = state
            self._hand_over(connection, state)
        for connection, state in list(self._door.items()):
            if now - state.accepted <= self.request_line_seconds:
                continue
            del self._door[connection]
            if state.started:  # asked, and found no place: refused, never queued
                self.refused += 1
                self._refuse(connection)
            else:
                selector.unregister(connection)
            self._close(connection)

    def _hand_over(self, connection: socket.socket, state: _Connection) -> None:
        request: Any = connection
        try:
            if self.tls is not None:
                request = self.tls.wrap_socket(
                    connection, server_side=True, do_handshake_on_connect=False
                )
                with self._changed:
                    self._open[request] = self._open.pop(connection)
            self.process_request(request, state.address)  # a thread of its own
        except Exception:
            with self._changed:
                self._open.pop(request, None)
                self._open.pop(connection, None)
            self._close(connection)

    def _refuse(self, connection: socket.socket) -> None:
        if self.tls is not None:
            return
        try:  # said without waiting, or not at all: the connection is closed either way
            connection.setblocking(False)
            connection.send(_REFUSAL)
        except OSError:
            pass

    @staticmethod
    def _close(connection: socket.socket) -> None:
        try:
            connection.close()
        except OSError:
            pass

    def _known_alone(self, host: str, now: float) -> bool:
        """A known scraper's address with no other connection at the door or in a place."""
        if not self._is_known(host, now):
            return False
        count = sum(1 for state in self._door.values() if state.host == host)
        return count + sum(1 for state in self._open.values() if state.host == host) <= 1

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
                        state.serving = time.monotonic()
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
        return self._known_alone(state.host, time.monotonic())

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
            if state is not None and state.serving is not None:
                # Pace: the slot frees no sooner than min_request_seconds after it was taken.
                # This thread sleeps without the GIL; a flood then costs training a bounded rate.
                rest = state.serving + self.min_request_seconds - time.monotonic()
                if rest > 0:
                    time.sleep(rest)
                with self._changed:
                    self._serving -= 1
                    self._changed.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a failed handshake or a vanished client: no traceback on the user's stderr


os.register_at_fork(after_in_child=_close_in_forked_child)


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
