"""Reading a run's event logs as they are: finished, still being written, or cut short.

A run directory holds one log per process (``<run_dir>/<run_id>/rank-<rank>.events.jsonl``,
see :mod:`stabmon.shared.rundir`). A process killed mid-write leaves its last line
without a newline; a process still running may be in the middle of one. Such a
line, and any line that is not a JSON object, is skipped with a note the report
shows, never an error. Reading takes what the files hold at that moment, so a
report of a running run is a snapshot.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from stabmon.errors import StabmonError
from stabmon.shared.rundir import ProcessRecord, boot_id, read_records, run_directory_name
from stabmon.shared.safefs import open_regular

__all__ = ["RankLog", "Run", "Selector", "count", "find_run", "number", "read_log", "read_run"]

_LOG_NAME = re.compile(r"^rank-(\d+)\.events\.jsonl$")
#: Records nest a few levels (environment, config); deeper is not a stabmon record.
MAX_DEPTH = 16
#: Plausible Unix times: after 1970, before the year 5000.
_MAX_TIME = 95_617_584_000.0
_MAX_INT = 2**63
#: Records written once a step has completed, whose ``step`` names it (docs/steps.md).
_AFTER_STEP = frozenset(
    {"step_sample", "epoch", "detach", "resume", "throughput", "stall_end", "slowdown_end"}
)
#: An event log larger than this is not read (a month of step samples is ~100 MB).
MAX_LOG_BYTES = 2**30
#: A line longer than this is skipped as malformed (a stall's every-thread stacks are ~100 KB).
MAX_LINE_BYTES = 2**24
#: Modification times this far ahead of the clock are a touched file, not the latest run.
_FUTURE_SLACK_SECONDS = 300.0
#: Records one log keeps at most (beyond: a note); a ``select`` may keep fewer. Records are
#: kept, lines are streamed: memory holds at most this many, whatever the file's size.
MAX_KEPT_RECORDS = 1_000_000
#: ``select(rank, record)``: the record to keep (or a slimmer one), None to keep nothing.
Selector = Callable[[int, dict[str, Any]], dict[str, Any] | None]


@dataclass
class RankLog:
    """One process's event log: its records in order, and what could not be read."""

    rank: int
    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: The process's run-directory record, if it is still there (running, or exited without
    #: detaching); None once it detached.
    registration: ProcessRecord | None = None

    def of(self, event: str) -> list[dict[str, Any]]:
        return [record for record in self.records if record.get("event") == event]

    @property
    def attach(self) -> dict[str, Any]:
        """The first attach record (the environment fingerprint), or an empty mapping."""
        attaches = self.of("attach")
        return attaches[0] if attaches else {}

    @property
    def config(self) -> dict[str, Any]:
        attaches = self.of("attach")
        config = attaches[-1].get("config") if attaches else None
        return config if isinstance(config, dict) else {}

    @property
    def last_step(self) -> int | None:
        """The index of the last step completed (docs/steps.md), None before the first.

        Read from the records written after a step completed (epoch ends, samples, detach,
        resume, throughput totals, the end of a stall whose step completed) and the
        heartbeat's count of steps done; not from anomalies, whose step may be one that
        never completed (a stall, a crash).
        """
        steps = [
            record["step"]
            for record in self.records
            if record.get("event") in _AFTER_STEP
            and isinstance(record.get("step"), int)
            # A stall ended by its phase's end, not by the step completing, names a step
            # still in progress (logs written before the field existed lack it).
            and not (record.get("event") == "stall_end" and record.get("completed") is False)
        ]
        if self.registration is not None and self.registration.steps:
            steps.append(self.registration.steps - 1)
        return max(steps, default=None)

    @property
    def steps(self) -> int:
        """Steps completed, across resumes: the last step's index plus one."""
        last = self.last_step
        return 0 if last is None else last + 1

    @property
    def state(self) -> str:
        """finished, running, exited, crashed or vanished (killed, or the machine went down)."""
        last_attach = max(
            (i for i, r in enumerate(self.records) if r.get("event") == "attach"), default=-1
        )
        if any(r.get("event") == "detach" for r in self.records[last_attach + 1 :]):
            return "finished"
        record = self.registration
        if record is not None and record.exit_status is not None:
            return "crashed" if record.exit_status == "exception" else "exited"
        if record is not None and _alive(record):
            return "running"
        return "vanished"


@dataclass
class Run:
    """A run: its directory and one log per rank, lowest rank first."""

    directory: Path
    ranks: list[RankLog]
    notes: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        for log in self.ranks:
            run = log.attach.get("run")
            if isinstance(run, str):
                return run
        return self.directory.name

    def anomalies(self) -> list[dict[str, Any]]:
        """Every anomaly of every rank, in time order."""
        found = [record for log in self.ranks for record in log.of("anomaly")]
        return sorted(found, key=lambda record: number(record.get("time")) or 0.0)


def find_run(
    path: Path, *, now: float | None = None, uid: int | None = None
) -> tuple[Path, list[Path], list[str]]:
    """The run directory ``path`` names, its event logs, and notes on the choice made.

    ``path`` may be one event log, a run's directory, or the run-directory root
    (``/var/tmp/stabmon``), in which case the run written to last is taken: of the
    caller's own runs (``uid``, default this process's effective uid) when there is one,
    since any user may write under the root. A modification time in the future (``now``,
    default the clock) is no sign of the latest run, only of a touched file: such a run is
    taken as the oldest.
    """
    if path.is_file():
        return path.parent, [path], []
    if not path.is_dir():
        raise StabmonError(f"{path} is neither a run directory nor an event log; pass one")
    logs = _logs_in(path)
    if logs:
        return path, logs, []
    limit = (time.time() if now is None else now) + _FUTURE_SLACK_SECONDS
    mine = os.geteuid() if uid is None else uid
    runs = []
    future = 0
    for run in _subdirectories(path):
        found = _logs_in(run)
        if not found:
            continue
        written = max(_mtime(log) for log in found)
        if written > limit:
            future += 1
            written = float("-inf")
        runs.append((_owner(run) == mine, written, run.name, run, found))
    if not runs:
        raise StabmonError(
            f"no event log (rank-<N>.events.jsonl) in {path} or in the runs under it; pass "
            "<run_dir>/<run_id>, as printed by stabmon at attach"
        )
    runs.sort(key=lambda entry: entry[:3])
    ours, _, _, chosen, logs = runs[-1]
    notes = []
    if len(runs) > 1:
        whose = "" if ours else " (another user's: none is yours)"
        notes.append(
            f"{path} holds {len(runs)} runs; this report is of the latest, {chosen.name}{whose}"
        )
    if future:
        notes.append(
            f"{future} run(s) under {path} have a modification time in the future; "
            "not taken as the latest"
        )
    return chosen, logs, notes


def read_run(path: Path, *, select: Selector | None = None, follow_symlinks: bool = True) -> Run:
    """Read every rank's log of the run at ``path`` (see :func:`find_run`).

    ``select`` and ``follow_symlinks`` are :func:`read_log`'s, for every log.
    """
    directory, logs, notes = find_run(path)
    registrations = _registrations(directory)
    ranks = []
    for log_path in logs:
        log = read_log(log_path, select=select, follow_symlinks=follow_symlinks)
        log.registration = registrations.get(log.rank)
        ranks.append(log)
    ranks.sort(key=lambda log: log.rank)
    return Run(directory, ranks, notes)


def read_log(
    path: Path, *, select: Selector | None = None, follow_symlinks: bool = True
) -> RankLog:
    """Every whole JSON record of ``path``; a cut-short or malformed line becomes a note.

    The file is read a line at a time, so memory holds the records kept, not the file.
    ``select(rank, record)`` returns the record to keep (it may slim it down) or None to
    keep nothing (a reader that folds step samples into its own figures as they go).
    ``follow_symlinks=False`` refuses a log that is a symbolic link (a note, not an error):
    on a shared node, a log another user could have swapped for a link.
    """
    match = _LOG_NAME.match(path.name)
    log = RankLog(rank=int(match.group(1)) if match else 0, path=path)
    dropped = 0
    for record in _records(path, log.notes, follow_symlinks):
        kept = record if select is None else select(log.rank, record)
        if kept is None:
            continue
        if len(log.records) >= MAX_KEPT_RECORDS:
            dropped += 1  # still read to the end: its notes count every malformed line
            continue
        log.records.append(kept)
    if dropped:
        log.notes.append(
            f"{path.name}: {dropped:,} records not kept, past the first {MAX_KEPT_RECORDS:,}"
        )
    return log


def _records(path: Path, notes: list[str], follow_symlinks: bool) -> Iterator[dict[str, Any]]:
    """The well-formed records of ``path`` in order; what is skipped goes to ``notes``."""
    try:  # never blocking (a FIFO under a log's name) and bounded
        stream = _open_log(path, follow_symlinks)
    except (OSError, ValueError) as error:
        notes.append(f"{path.name}: not read ({error})")
        return
    bad: list[int] = []  # the first malformed lines' numbers
    skipped = size = 0
    with stream:
        for index, line in enumerate(iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b""), 1):
            size += len(line)
            if size > MAX_LOG_BYTES:  # it grew past the bound while being read
                notes.append(f"{path.name}: only its first {MAX_LOG_BYTES} bytes were read")
                break
            last = not line.endswith(b"\n")  # the writer had not finished it
            record = None
            if len(line) > MAX_LINE_BYTES:  # no stabmon record is this long: skip to its end
                # (unless the newline was its last byte read: the next line is a record)
                last = last and _skip_line(stream)
            elif not line.strip():
                continue
            else:
                record = _parse(line)
            if record is not None:
                if last:
                    notes.append(f"{path.name}: the last line has no newline (the process "
                                 "stopped while writing)")  # fmt: skip
                yield record
            elif last:
                notes.append(
                    f"{path.name}: the last line ({len(line)} bytes) is incomplete and was "
                    "skipped: the process was writing it when it was read or when it stopped"
                )
            else:
                skipped += 1
                bad += [index] if len(bad) < 10 else []
    if skipped:
        shown = ", ".join(map(str, bad)) + (" ..." if skipped > len(bad) else "")
        notes.append(f"{path.name}: {skipped} malformed line(s) skipped (line {shown})")


def _skip_line(stream: BinaryIO) -> bool:
    """Read past the rest of an overlong line; True when it ended without a newline."""
    while chunk := stream.readline(MAX_LINE_BYTES):
        if chunk.endswith(b"\n"):
            return False
    return True


def _open_log(path: Path, follow_symlinks: bool) -> BinaryIO:
    """``path`` opened for reading as :func:`stabmon.shared.safefs.read_regular` opens it: no final
    symlink unless ``follow_symlinks``, never blocking, a regular file of at most
    ``MAX_LOG_BYTES`` (else an error)."""
    fd, info = open_regular(path, os.O_RDONLY, follow_symlinks=follow_symlinks)
    if info.st_size > MAX_LOG_BYTES:
        os.close(fd)
        raise ValueError(f"{path}: larger than {MAX_LOG_BYTES} bytes")
    return open(fd, "rb", buffering=2**16)


def _parse(line: bytes) -> dict[str, Any] | None:
    """The record a line holds, or None when it is not a well-formed stabmon record."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return record if isinstance(record, dict) and _well_formed(record) else None


def _well_formed(record: dict[str, Any]) -> bool:
    """Whether the fields every page reads have the types stabmon writes (and depth is sane)."""
    when = record.get("time")
    if when is not None and not (_is_number(when) and 0 <= when <= _MAX_TIME):
        return False
    if not isinstance(record.get("event"), str):
        return False  # every record stabmon writes names its event (``{}`` is not one)
    for key in ("event", "kind", "run"):
        if key in record and not isinstance(record[key], str):
            return False
    for key in ("step", "rank", "epoch"):
        value = record.get(key)
        if value is not None and not (_is_integer(value) and abs(value) < _MAX_INT):
            return False
    return _depth(record) <= MAX_DEPTH


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _depth(value: object) -> int:
    """How deep ``value`` nests, walked without recursion (a hostile line can nest 10**5 deep)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if level > MAX_DEPTH:
            return level
        deepest = max(deepest, level)
        if isinstance(item, dict):
            stack.extend((child, level + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, level + 1) for child in item)
    return deepest


def number(value: object) -> float | None:
    """A record's number: floats, ints, and the strings the log writes for nan and inf."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float
            return None
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return None


#: Counts beyond this are not exact as floats; a record claiming more is hostile or corrupt.
MAX_COUNT = 2**53


def count(value: object) -> int | None:
    """A record's count (steps, samples, tokens): a whole number from 0 to ``MAX_COUNT``,
    else None, so that sums and ratios of counts never overflow a float."""
    found = number(value)
    if found is None or not 0 <= found <= MAX_COUNT or not found.is_integer():
        return None
    return int(found)


def _logs_in(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if _LOG_NAME.match(p.name) and p.is_file())
    except OSError:
        return []


def _subdirectories(path: Path) -> Iterator[Path]:
    """Run directories under ``path``; a symlink is not one (it may point anywhere)."""
    try:
        with os.scandir(path) as entries:
            found = [Path(entry.path) for entry in entries if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return
    yield from found


def _mtime(path: Path) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return float("-inf")


def _owner(path: Path) -> int | None:
    try:
        return os.lstat(path).st_uid
    except OSError:
        return None


def _registrations(directory: Path) -> dict[int, ProcessRecord]:
    records, _ = read_records(directory.parent)
    return {
        record.rank: record
        for record in records
        if run_directory_name(record.run) == directory.name
    }


def _alive(record: ProcessRecord) -> bool:
    """Whether the registered process is still running on this machine (same boot)."""
    if record.boot_id and record.boot_id != boot_id():
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True
