"""``stabmon status``'s NaN lines: per run, the latest provenance verdict and the rank that
went non-finite first, read from the run directory's event logs.

The scrape says *that* a rank saw a non-finite value (the table's ``nonfinite`` column);
where it came from is in the ``provenance`` records the ranks wrote (see
:mod:`stabmon.probes.provenance`), as ``stabmon report`` shows them. Only the runs of the
listed records that need it are read: one whose scraped ranks counted a non-finite value,
or one with a rank that did not answer (it may have died of it). A healthy run costs no read.

A status is a health check, so a log is not parsed whole as the report parses it (a long
run's log is mostly step samples): it is read a line at a time, and only the lines that
name a provenance verdict or a non-finite anomaly are parsed. Every record is untrusted
(any user may write under the run-directory root): the directory must be the record
owner's and not a symlink, and so must each log (checked on the open file: no symlink
followed, no FIFO, at most
:data:`~stabmon.report.events.MAX_LOG_BYTES`, lines past
:data:`~stabmon.report.events.MAX_LINE_BYTES` skipped, and :data:`MAX_READ_BYTES` in all
for one status, past which the line says the logs were read in part and names the
``stabmon report`` that reads them all); each record is folded as it is
read, so memory holds a few numbers per rank whatever the log holds; text from a record is
shown only as printable characters, cut short (no escape sequence reaches the terminal),
and a field of the wrong type reads as absent. The first non-finite rank is
:func:`stabmon.report.incidents.first_nonfinite_rank`, the report's own rule.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabmon.report.events import MAX_LINE_BYTES, MAX_LOG_BYTES, RankLog, Run, count
from stabmon.report.incidents import first_nonfinite_rank
from stabmon.report.status import RankStatus
from stabmon.report.status_targets import RegisteredTarget
from stabmon.shared.rundir import run_directory_name
from stabmon.shared.safefs import open_regular

__all__ = ["MAX_RUNS", "provenance_lines"]

#: Runs whose logs one status reads at most (the others get a line saying so).
MAX_RUNS = 16
#: Logs read per run at most (the lowest ranks).
MAX_LOGS = 1024
#: Modules named after the producer at most ("and N more").
MAX_PROPAGATORS = 5
#: Characters shown of one name from a record.
MAX_NAME = 120
#: Bytes of event logs one status reads at most, all runs together (a few seconds): a
#: health check must return; a thousand ranks' logs of a long run are terabytes. Past it
#: the line says it read the logs in part and names the command that reads them all.
MAX_READ_BYTES = 2**28
#: Forward verdicts' steps kept per rank, the earliest (what the first-rank rule reads).
_FORWARD_STEPS = 16
_LOG_NAME = re.compile(r"^rank-(\d{1,9})\.events\.jsonl$")
#: What a line must hold to be parsed: the records folded name one of these.
_WANTED = re.compile(rb'"provenance"|"nonfinite_(?:grad|loss)"')
_NONFINITE = frozenset({"nonfinite_grad", "nonfinite_loss"})
_DIRECTIONS = frozenset({"forward", "backward", "weights"})


def provenance_lines(
    statuses: Sequence[RankStatus], targets: Sequence[str | RegisteredTarget], root: Path
) -> list[str]:
    """One line per run that has a NaN to explain: its latest provenance verdict (producer,
    pass, step, rank, the first modules that passed it on) and its first non-finite rank.

    ``targets`` are the records ``statuses`` were scraped for (URLs given on the command
    line have no run directory and are left out); ``root`` is the ``--run-dir`` they were
    listed from (a run-directory root, or one run's directory).
    """
    owners: dict[str, int] = {}
    for target in targets:
        if isinstance(target, RegisteredTarget):
            owners.setdefault(target.run, target.owner_uid)
    wanted = sorted(
        {s.run for s in statuses if s.run in owners and (s.nonfinite or s.error is not None)}
    )
    base = root.parent if any(root.glob("rank-*.json")) else root
    lines = []
    budget = _Budget(MAX_READ_BYTES)
    for run in wanted[:MAX_RUNS]:
        line = _run_line(run, base / run_directory_name(run), owners[run], budget)
        if line is not None:
            lines.append(line)
    if len(wanted) > MAX_RUNS:
        lines.append(
            f"{len(wanted) - MAX_RUNS} more run(s) with a non-finite value or a silent rank; "
            "stabmon status --run <id> or stabmon report <run directory> explains each"
        )
    return lines


@dataclass
class _Budget:
    """The bytes this status may still read (:data:`MAX_READ_BYTES`), and whether a log of
    the run being read was left unread, or read in part, for want of them."""

    left: int
    short: bool = False


@dataclass
class _Fold:
    """What one rank's log says, folded as it is read."""

    rank: int
    first: int | None = None  # the first non-finite step
    first_kinds: set[str] = field(default_factory=set)
    forward_steps: list[int] = field(default_factory=list)  # a max-heap (negated), bounded
    verdict: dict[str, Any] | None = None  # the latest (highest step, then the last written)

    def fold(self, record: dict[str, Any]) -> None:
        step = count(record.get("step"))
        if step is None:
            return
        event = record.get("event")
        if event == "anomaly" and record.get("kind") in _NONFINITE:
            if self.first is None or step < self.first:
                self.first, self.first_kinds = step, set()
            if step == self.first:
                self.first_kinds.add(str(record["kind"]))
        elif event == "provenance":
            if not isinstance(record.get("producer"), (str, type(None))):
                return  # malformed: not a verdict (None is "not reproduced")
            if record.get("direction") == "forward" and -step not in self.forward_steps:
                heapq.heappush(self.forward_steps, -step)
                if len(self.forward_steps) > _FORWARD_STEPS:
                    heapq.heappop(self.forward_steps)  # the latest goes: the earliest matter
            if self.verdict is None or step >= self.verdict["step"]:
                self.verdict = _verdict(step, record)

    def log(self, path: Path) -> RankLog:
        """The few records the first-rank rule reads, as a log of their own."""
        records: list[dict[str, Any]] = [
            {"event": "anomaly", "kind": kind, "step": self.first} for kind in self.first_kinds
        ]
        records += [
            {"event": "provenance", "direction": "forward", "step": -negated}
            for negated in self.forward_steps
        ]
        return RankLog(rank=self.rank, path=path, records=records)


def _verdict(step: int, record: dict[str, Any]) -> dict[str, Any]:
    """A provenance record's fields as status shows them, checked and bounded."""
    producer = record.get("producer")
    direction = record.get("direction")
    listed = record.get("propagators")
    names = listed if isinstance(listed, list) else []
    shown = [_printable(name) for name in names[:MAX_PROPAGATORS] if isinstance(name, str)]
    watched = record.get("watched_steps")
    return {
        "step": step,
        "producer": None if producer is None else _printable(producer),
        "direction": direction if direction in _DIRECTIONS else None,
        "propagators": shown,
        "more": max(len(names) - MAX_PROPAGATORS, 0),
        "watched": [
            n
            for s in (watched if isinstance(watched, list) else [])[:8]
            if (n := count(s)) is not None
        ],
    }


def _run_line(run: str, directory: Path, owner: int, budget: _Budget) -> str | None:
    folds: list[_Fold] = []
    budget.short = False
    for rank, path in _logs(directory, owner):
        fold = _Fold(rank)
        for record in _records(path, owner, budget):
            fold.fold(record)
        folds.append(fold)
    short = budget.short
    first = first_nonfinite_rank(Run(directory, [fold.log(directory) for fold in folds]))
    verdicts = [(fold.rank, fold.verdict) for fold in folds if fold.verdict is not None]
    shown_run = _printable(run)
    first_text = "" if first is None else f"first non-finite: rank {first[0]} at step {first[1]}"
    if short:  # what was not read may hold an earlier non-finite step or a later verdict
        first_text = (first_text + " among the logs read; " if first_text else "") + (
            f"its logs were read in part (stabmon status reads {MAX_READ_BYTES / 2**20:g} MiB at "
            f"most): stabmon report {_printable(str(directory), cut=False)} reads them all"
        )
    if not verdicts:
        if first is None and not short:
            return None
        return f"run {shown_run}: {first_text}" + ("" if short else " (no verdict yet)")
    latest = max(verdict["step"] for _, verdict in verdicts)
    at_latest = [(rank, verdict) for rank, verdict in verdicts if verdict["step"] == latest]
    rank, verdict = next(
        ((r, v) for r, v in at_latest if first is not None and r == first[0]), at_latest[0]
    )
    line = (
        f"run {shown_run}: NaN provenance, step {latest}, rank {rank}: {_explained(verdict, rank)}"
    )
    return f"{line}; {first_text}" if first_text else line


def _explained(verdict: dict[str, Any], rank: int) -> str:
    producer, direction = verdict["producer"], verdict["direction"]
    if producer is None:
        watched = ", ".join(map(str, verdict["watched"]))
        clean = f" (steps {watched} were clean)" if watched else ""
        return (
            f"not reproduced{clean}: a transient; look at that step's batch "
            f"(rank-{rank}.skip_batches.json) and at the hardware"
        )
    module = producer or "(root)"
    if direction == "weights":
        return (
            f"already in the weights when watched ({module} first): no producer can be "
            "told; on_anomaly.nonfinite_grad: skip holds such steps back"
        )
    where = f"in the {direction} pass" if direction is not None else "in an unnamed pass"
    passed = ", ".join(verdict["propagators"])
    if verdict["more"]:
        passed += f" and {verdict['more']} more"
    return f"produced by {module} {where}" + (f", passed on by {passed}" if passed else "")


def _logs(directory: Path, owner: int) -> list[tuple[int, Path]]:
    """The event logs of a run directory of ``owner``'s (not a symlink), lowest ranks first;
    none when the directory is not the record owner's."""
    try:
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != owner:
            return []
        with os.scandir(directory) as entries:
            # The lowest ranks, kept as the listing streams by: a directory of millions of
            # entries (any user's) costs a status MAX_LOGS names of memory, not millions.
            found = heapq.nsmallest(
                MAX_LOGS,
                (
                    (int(match.group(1)), entry.name)
                    for entry in entries
                    if (match := _LOG_NAME.match(entry.name)) is not None
                ),
            )
    except OSError:
        return []
    return [(rank, directory / name) for rank, name in found]


def _records(path: Path, owner: int, budget: _Budget) -> Iterator[dict[str, Any]]:
    """The records of ``path`` that may be a verdict or a non-finite anomaly (the others are
    not parsed); nothing from a log that is not ``owner``'s regular file, or too large; no
    more than ``budget`` has left (it says when it ran short)."""
    try:
        fd, info = open_regular(path, os.O_RDONLY)  # never a symlink, FIFO or device
    except OSError:
        return
    if info.st_uid != owner or info.st_size > MAX_LOG_BYTES:
        os.close(fd)
        return
    read, most = 0, min(MAX_LOG_BYTES, budget.left)
    try:
        stream = open(fd, "rb", buffering=2**16)  # noqa: SIM115  # closed by the with below
    except OSError:
        os.close(fd)
        budget.short = True
        return
    with stream:
        try:
            if info.st_size > most or budget.left <= 0:
                budget.short = True
            for line in iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b""):
                read += len(line)
                if read > most:  # past the budget, or it grew past the bound while read
                    budget.short = budget.short or most < MAX_LOG_BYTES
                    return
                if len(line) > MAX_LINE_BYTES:  # no stabmon record is this long: to its end
                    rest = line
                    while rest and not rest.endswith(b"\n") and read <= most:
                        rest = stream.readline(MAX_LINE_BYTES)
                        read += len(rest)  # bounded too: the log may grow while skipped
                    continue
                if _WANTED.search(line) is None:
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                    continue
                if isinstance(record, dict):
                    yield record
        except OSError:  # a read that fails (EIO, a file system gone): the rest is unread
            budget.short = True
        finally:
            budget.left -= min(read, most)


def _printable(text: str, *, cut: bool = True) -> str:
    """``text`` with every character a terminal could act on (controls, escapes, bidi
    overrides: all that ``str.isprintable`` refuses) shown as ``?``, cut to MAX_NAME unless
    ``cut`` is False (a path in a command to run, bounded by the system's path length)."""
    kept = text[:MAX_NAME] if cut else text
    shown = "".join(character if character.isprintable() else "?" for character in kept)
    return shown + ("..." if len(kept) < len(text) else "")
