"""The exporter's connection limits: shared by the exporter and its HTTP server classes.

A leaf, so the exporter can name its limits without loading the HTTP server, which it
imports only when it starts serving.
"""

__all__ = ["BACKLOG", "MAX_CONNECTIONS", "MIN_REQUEST_SECONDS", "REQUEST_SECONDS"]

#: Requests served at once; more wait in the listen backlog.
MAX_CONNECTIONS = 4
#: Every request ends this long after it was accepted, however slowly its client sends.
REQUEST_SECONDS = 10.0
#: The listen backlog (socketserver's default is 5).
BACKLOG = 128
#: A connection slot is held at least this long: at most MAX_CONNECTIONS / this many
#: requests a second are served (16), however many clients flood the port. Prometheus
#: scrapes every few seconds; a scrape that arrives in a flood waits its turn in the backlog.
#: Each served request costs the training thread GIL time: a shorter slot let a 50-client
#: flood cost a loop more than its 5% budget (bench/scrape_flood.py measures it).
MIN_REQUEST_SECONDS = 0.25
