"""Publication only: Prometheus exposition and the event log; no torch here."""
