"""The exporter's connection limits: shared by the exporter and its HTTP server classes.

A leaf, so the exporter can name its limits without loading the HTTP server, which it
imports only when it starts serving.
"""

__all__ = [
    "BACKLOG",
    "MAX_CONNECTIONS",
    "MIN_REQUEST_SECONDS",
    "PENDING",
    "REQUEST_LINE_SECONDS",
    "REQUEST_SECONDS",
]

#: Requests served at once; one of them is kept for a known scraper (see http_server).
MAX_CONNECTIONS = 4
#: Connections given a thread beyond those being served (finishing their request, or
#: waiting for a slot); one that finds no place within a second is refused, never queued.
PENDING = 8
#: A connection that has not sent its whole request (line and headers) this long after it
#: was accepted is closed: idle connections cannot hold the server.
REQUEST_LINE_SECONDS = 1.0
#: Every request ends this long after it was accepted, however slowly its client sends.
REQUEST_SECONDS = 10.0
#: The listen backlog: connections the kernel holds while the server's door (256
#: connections, each a second at most) is full; the kernel drops what comes beyond.
BACKLOG = 64
#: A connection slot is held at least this long: at most MAX_CONNECTIONS / this many
#: requests a second are served (16), however many clients flood the port. Prometheus
#: scrapes every few seconds; a scrape that arrives in a flood waits its turn in the backlog.
#: Each served request costs the training thread GIL time: a shorter slot let a 50-client
#: flood cost a loop more than its 5% budget (bench/scrape_flood.py measures it).
MIN_REQUEST_SECONDS = 0.25
