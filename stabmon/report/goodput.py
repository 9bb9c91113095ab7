"""Goodput and throughput of a run, across restarts, from its event logs.

Goodput is the share of wall time spent in the training phases (forward, backward,
optimizer step). Each process writes ``throughput`` records with its running totals
(seconds per phase, steps, samples, tokens) every ``throughput.record_seconds`` and at
detach; each rank's history is cut into *incarnations* at its ``attach`` records. Per
rank, the wall time runs from the first attach to the last record, and it is spent as:

- ``training``: forward, backward and optimizer seconds, less the two below;
- ``stalled``: time a stall held (``stall_end``, else the stall anomaly), taken out of the
  phase it stalled in;
- ``recomputed``: steps run again after a restart resumed from an older checkpoint, at the
  previous incarnation's mean training seconds per step;
- ``data_wait`` and each named phase (``eval``, ``checkpoint``...);
- ``startup``: a process's time not in any phase (attach to the first step: imports of the
  loop, compilation warm-up, loading the checkpoint; and after the last step);
- ``restarts``: the wall time no process of the rank accounted for (between one process's
  last record and the next one's attach; a killed process's last interval is lost here too).

Needs no torch; reads what :mod:`stabmon.report.events` read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from html import escape
from typing import Any

from stabmon.report.events import RankLog, Run, count, number

__all__ = ["RankGoodput", "goodput_section", "rank_goodput", "run_goodput"]

TRAINING_PHASES = ("forward", "backward", "optimizer")
#: Order of the causes in the report's table; named phases come after data_wait.
_LEADING = ("training", "data_wait")
_TRAILING = ("stalled", "recomputed", "startup", "restarts")


@dataclass
class RankGoodput:
    """One rank's wall time, how it was spent (seconds by cause), and its throughput."""

    rank: int
    wall_seconds: float = 0.0
    spent: dict[str, float] = field(default_factory=dict)
    incarnations: int = 0
    steps: int = 0
    samples: int = 0
    tokens: int = 0
    mfu: float | None = None
    flops_per_step: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.wall_seconds <= 0:
            return None
        return self.spent.get("training", 0.0) / self.wall_seconds


def _incarnations(log: RankLog) -> list[list[dict[str, Any]]]:
    """The records of each process of this rank, cut at its attach records."""
    found: list[list[dict[str, Any]]] = []
    for record in log.records:
        if record.get("event") == "attach" or not found:
            found.append([])
        found[-1].append(record)
    return [records for records in found if any(r.get("event") == "attach" for r in records)]


def _stalls(records: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(phase, seconds) of each stall: the anomaly names the phase, stall_end the length."""
    stalls: list[tuple[str, float]] = []
    open_phase: str | None = None
    open_seconds = 0.0
    for record in records:
        event = record.get("event")
        if event == "anomaly" and record.get("kind") == "stall":
            open_phase = str(record.get("phase", ""))
            open_seconds = number(record.get("silent_seconds")) or 0.0
        elif event == "stall_end" and open_phase is not None:
            stalls.append((open_phase, number(record.get("stalled_seconds")) or open_seconds))
            open_phase = None
    if open_phase is not None:  # the process ended inside a stall
        stalls.append((open_phase, open_seconds))
    return stalls


def rank_goodput(log: RankLog) -> RankGoodput | None:
    """Goodput of one rank, or None when its log holds no throughput record."""
    result = RankGoodput(rank=log.rank)
    spent: dict[str, float] = {}
    first_attach: float | None = None
    last_time: float | None = None
    accounted = 0.0
    previous_completed: int | None = None
    previous_step_seconds: float | None = None
    for records in _incarnations(log):
        attach_time = number(records[0].get("time"))
        times = [t for r in records if (t := number(r.get("time"))) is not None]
        if attach_time is None or not times:
            continue
        first_attach = attach_time if first_attach is None else first_attach
        last_time = max(times) if last_time is None else max(last_time, *times)
        totals = [r for r in records if r.get("event") == "throughput"]
        if not totals:
            continue
        result.incarnations += 1
        last = totals[-1]
        phases = {
            str(name): seconds
            for name, value in _mapping(last.get("phase_seconds")).items()
            if (seconds := number(value)) is not None and seconds >= 0
        }
        # Phases never outlast the process; if rounding says so, they are the process's time.
        uptime = max(number(last.get("uptime_seconds")) or 0.0, sum(phases.values()))
        accounted += uptime
        stalled = _take_stalls(records, phases)
        if stalled:
            spent["stalled"] = spent.get("stalled", 0.0) + stalled
        training = sum(phases.pop(phase, 0.0) for phase in TRAINING_PHASES)
        steps = count(last.get("steps")) or 0
        resumes = [r for r in records if r.get("event") == "resume"]
        lost = 0.0
        if resumes and previous_completed is not None and previous_step_seconds is not None:
            redone = max(0, previous_completed - _completed(resumes[0]))
            lost = min(training, redone * previous_step_seconds)
            training -= lost
            spent["recomputed"] = spent.get("recomputed", 0.0) + lost
        spent["training"] = spent.get("training", 0.0) + training
        for phase, seconds in phases.items():
            spent[phase] = spent.get(phase, 0.0) + seconds
        # training was cut by what was recomputed: put it back to find the time in no phase.
        startup = uptime - (training + lost) - sum(phases.values()) - stalled
        spent["startup"] = spent.get("startup", 0.0) + max(0.0, startup)
        previous_completed = _completed(last)
        previous_step_seconds = training / steps if steps else None
        _add_counts(result, last)
    if not result.incarnations or first_attach is None or last_time is None:
        return None
    result.wall_seconds = max(last_time - first_attach, accounted)
    spent["restarts"] = max(0.0, result.wall_seconds - accounted)
    result.spent = spent
    return result


def _take_stalls(records: list[dict[str, Any]], phases: dict[str, float]) -> float:
    """Take each stall's seconds out of the phase it stalled in; the seconds taken."""
    stalled = 0.0
    for phase, seconds in _stalls(records):
        taken = min(seconds, phases.get(phase, 0.0))
        if taken > 0:
            phases[phase] -= taken
            stalled += taken
    return stalled


def _add_counts(result: RankGoodput, last: Mapping[str, Any]) -> None:
    """Add one process's last totals (steps, samples, tokens; MFU and FLOPs if it had them)."""
    result.steps += count(last.get("steps")) or 0
    result.samples += count(last.get("samples")) or 0
    result.tokens += count(last.get("tokens")) or 0
    mfu = number(last.get("mfu"))
    result.mfu = mfu if mfu is not None else result.mfu
    flops = number(last.get("flops_per_step"))
    result.flops_per_step = flops if flops is not None else result.flops_per_step


def _completed(record: Mapping[str, Any]) -> int:
    """Steps completed when a record between steps was written: its ``step`` is the index of
    the last one (docs/steps.md), None before the first."""
    step = record.get("step")
    return step + 1 if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0


def run_goodput(run: Run) -> list[RankGoodput]:
    """Goodput of each rank that wrote throughput records, lowest rank first."""
    return [found for log in run.ranks if (found := rank_goodput(log)) is not None]


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _causes(ranks: list[RankGoodput]) -> list[str]:
    named = sorted({cause for r in ranks for cause in r.spent} - set(_LEADING) - set(_TRAILING))
    return [*_LEADING, *named, *_TRAILING]


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def _rate(count: int, seconds: float) -> str:
    return f"{count / seconds:,.1f}" if count and seconds > 0 else "&mdash;"


def goodput_section(run: Run) -> str:
    """The report's "Goodput and throughput" section (HTML)."""
    ranks = run_goodput(run)
    head = '<section id="goodput"><h2>Goodput and throughput</h2>'
    if not ranks:
        return (
            head + "<p>No throughput record in the event logs (stabmon older than this report, "
            "or the run ended before its first record).</p></section>"
        )
    wall = sum(r.wall_seconds for r in ranks)
    training = sum(r.spent.get("training", 0.0) for r in ranks)
    restarts = max(r.incarnations for r in ranks) - 1
    summary = (
        f"<p><b>Goodput {training / wall:.1%}</b> of {_duration(wall / len(ranks))} wall time "
        f"per rank ({len(ranks)} rank{'s' if len(ranks) != 1 else ''}, {restarts} "
        f"restart{'s' if restarts != 1 else ''}): the share spent in forward, backward and the "
        "optimizer step. Where the rest went:</p>"
    )
    rows = []
    for cause in _causes(ranks):
        seconds = sum(r.spent.get(cause, 0.0) for r in ranks)
        if seconds <= 0 and cause != "training":
            continue
        rows.append(
            f"<tr><td>{escape(cause)}</td><td>{_duration(seconds / len(ranks))}</td>"
            f"<td>{seconds / wall:.1%}</td></tr>"
        )
    causes = (
        "<table><tr><th>time in</th><th>per rank</th><th>share</th></tr>"
        + "".join(rows)
        + "</table>"
    )
    throughput_rows = []
    for r in ranks:
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "&mdash; (CPU, or GPU peak unknown)"
        flops = f"{r.flops_per_step:.3g}" if r.flops_per_step is not None else "&mdash;"
        throughput_rows.append(
            f"<tr><td>{r.rank}</td><td>{r.steps:,}</td><td>{_rate(r.steps, r.wall_seconds)}</td>"
            f"<td>{_rate(r.samples, r.wall_seconds)}</td><td>{_rate(r.tokens, r.wall_seconds)}"
            f"</td><td>{flops}</td><td>{mfu}</td><td>{r.ratio or 0.0:.1%}</td></tr>"
        )
    throughput = (
        "<table><tr><th>rank</th><th>steps</th><th>steps/s</th><th>samples/s</th>"
        "<th>tokens/s</th><th>FLOPs/step</th><th>MFU (last)</th><th>goodput</th></tr>"
        + "".join(throughput_rows)
        + '</table><p class="sub">Rates are over wall time, restarts included. MFU is the '
        "last block's (training phases only); see docs/throughput.md.</p>"
    )
    return head + summary + causes + throughput + "</section>"
