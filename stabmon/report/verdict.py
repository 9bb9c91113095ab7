"""One line that says whether a run was healthy, and if not, what went wrong and when."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from stabmon.report.events import Run, number
from stabmon.report.hang import hang_findings

__all__ = ["Verdict", "judge", "when"]

_STATE_TEXT = {
    "finished": "finished (detached)",
    "running": "still running",
    "exited": "exited without detaching",
    "crashed": "crashed on an uncaught exception",
    "vanished": "stopped without a word (killed, out of memory, or the machine went down)",
}


@dataclass(frozen=True)
class Verdict:
    """``healthy`` and a headline, with one line per finding below it."""

    healthy: bool
    headline: str
    findings: tuple[str, ...]


def judge(run: Run) -> Verdict:
    """Healthy means: no anomaly on any rank, and no rank that crashed or vanished."""
    anomalies = run.anomalies()
    states = {log.rank: log.state for log in run.ranks}
    steps = max((log.steps for log in run.ranks), default=0)
    broken = {rank: state for rank, state in states.items() if state in ("crashed", "vanished")}
    ranks = f"{len(run.ranks)} rank{'s' if len(run.ranks) != 1 else ''}"
    overall = _overall_state(states)
    findings: list[str] = []
    for rank, state in broken.items():
        log = next(log for log in run.ranks if log.rank == rank)
        last = log.records[-1] if log.records else {}
        findings.append(
            f"rank {rank} {_STATE_TEXT[state]} {_after(log.last_step)}; its last record was "
            f"written {when(number(last.get('time')))}"
        )
    counts = Counter(str(record.get("kind")) for record in anomalies)
    for kind, count in counts.items():
        records = [r for r in anomalies if r.get("kind") == kind]
        first, last = records[0], records[-1]
        where = _where(first)
        line = f"{kind} x{count}: first {where}"
        if count > 1:
            line += f", last {_where(last)}"
        findings.append(line)
    findings.extend(hang_findings(run))
    if not anomalies and not broken:
        return Verdict(
            True, f"Healthy: {steps:,} steps on {ranks}, no anomalies; {overall}.", tuple(findings)
        )
    parts = []
    if anomalies:
        first = anomalies[0]
        parts.append(
            f"{len(anomalies)} anomal{'ies' if len(anomalies) != 1 else 'y'} "
            f"({', '.join(f'{kind} x{n}' for kind, n in counts.items())}); the first, "
            f"{first.get('kind')}, {_where(first)}"
        )
    if broken:
        parts.append(
            ", ".join(f"rank {r} {_STATE_TEXT[s].split(' (')[0]}" for r, s in broken.items())
        )
    headline = f"Not healthy: {'; '.join(parts)}. {steps:,} steps on {ranks}; {overall}."
    return Verdict(False, headline, tuple(findings))


def when(unix: float | None) -> str:
    """A record's time for a person (local time, to the second)."""
    if unix is None:
        return "at an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def _after(last_step: int | None) -> str:
    return "before its first step" if last_step is None else f"after step {last_step}"


def _where(record: dict[str, object]) -> str:
    rank = record.get("rank")
    return f"at step {record.get('step')} on rank {rank} ({when(number(record.get('time')))})"


def _overall_state(states: dict[int, str]) -> str:
    values = set(states.values())
    if not values:
        return "no records"
    if len(values) == 1:
        return _STATE_TEXT[values.pop()].split(" (")[0]
    parts = []
    for state in sorted(values):
        ranks = [rank for rank, value in states.items() if value == state]
        plural = "s" if len(ranks) > 1 else ""
        parts.append(f"rank{plural} {', '.join(map(str, ranks))} {_short(state)}")
    return ", ".join(parts)


def _short(state: str) -> str:
    return _STATE_TEXT[state].split(" (")[0]
