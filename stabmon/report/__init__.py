"""Seeing a run without Grafana: ``stabmon report`` (HTML from event logs) and ``stabmon status``.

- :mod:`stabmon.report.events` reads a run's event logs, tolerating lines cut short;
- :mod:`stabmon.report.verdict` says in one line whether the run was healthy;
- :mod:`stabmon.report.plots` draws with matplotlib (the optional ``report`` extra);
- :mod:`stabmon.report.html` assembles the self-contained page;
- :mod:`stabmon.report.status` scrapes running exporters into a table.

None of them imports torch: both commands run where only the logs or the
network are, and start fast.
"""
