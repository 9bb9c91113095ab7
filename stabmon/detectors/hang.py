"""Hang triage: what a stalled rank is doing, and which rank holds the others up.

Pure functions of host values, no threads, no torch. A stalled rank classifies
its own main thread (:func:`classify`) into one of :data:`HANG_STATES`; once
the ranks of a run stall, :func:`judge` compares their evidence and names the
rank(s) whose state differs from the majority's, with a reason class from
:data:`HANG_REASONS`. The same comparison runs four ways: in each rank over
the records of its node (:mod:`stabmon.wiring.stall_action`), in the node daemon over
the same records (:mod:`stabmon.daemon.hang`), in ``stabmon status`` over
scraped gauges, and in PromQL across nodes (the shipped
``StabmonTrainingStalled`` description), so no collective and no coordinator
is added.

No verdict unless every known rank is stalled: a rank that is not stalled (rank
0 writing a checkpoint inside ``mon.phase("checkpoint")``, every rank in a long
evaluation) is working, and the ranks waiting on it in a barrier have no
culprit to name.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from stabmon.contract import HANG_REASONS, HANG_STATES

__all__ = ["HANG_REASONS", "HANG_STATES", "RankEvidence", "Verdict", "classify", "judge"]

_FRAME = re.compile(r'File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<function>[^\n]*)')
#: Innermost code lines that read or write files (torch.save, a write, an fsync...).
_IO_CODE = re.compile(
    r"\b(torch\.save|torch\.load|fsync|\.write\(|\.read\(|\.readinto\(|\.flush\(|open\(|"
    r"shutil\.|copyfile)"
)
#: stabmon's own files, wherever it is installed: skipped when naming where a thread waits.
#: (A path test, not a "/stabmon/" substring: a user's project or checkout may be named so.)
_PACKAGE_DIRECTORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LOCK_FUNCTIONS = frozenset({"acquire", "wait", "join", "__enter__"})
#: Innermost code lines that wait on a lock, a condition or a thread.
_LOCK_CODE = re.compile(r"\.acquire\(|\.join\(|\.wait\(|^with\b.*(lock|mutex|cond)", re.IGNORECASE)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    code: str

    @property
    def where(self) -> str:
        """``loader.py:42 in fetch``: short enough for an alert, precise enough to open."""
        name = self.file.replace("\\", "/").rsplit("/", 1)[-1]
        return f"{name}:{self.line} in {self.function}"


def parse_stack(stack: Sequence[str]) -> list[Frame]:
    """Frames of a ``traceback.format_stack`` list, outermost first."""
    frames = []
    for entry in stack:
        match = _FRAME.search(entry)
        if match is None:
            continue
        code = entry[match.end() :].strip()
        frames.append(Frame(match["file"], int(match["line"]), match["function"].strip(), code))
    return frames


def _is_stabmon(file: str) -> bool:
    return os.path.abspath(file).startswith(_PACKAGE_DIRECTORY)


def classify(stack: Sequence[str], *, phase: str, collective: str | None) -> tuple[str, str]:
    """The state of a stalled main thread, and where it is (innermost frame outside stabmon).

    ``collective`` is the torch.distributed call the thread is inside, if any
    (:mod:`stabmon.probes.collectives`); ``phase`` the loop phase.
    """
    frames = [frame for frame in parse_stack(stack) if not _is_stabmon(frame.file)]
    innermost = frames[-1] if frames else None
    where = innermost.where if innermost is not None else ""
    if collective is not None:
        return "collective", f"{collective} at {where}" if where else collective
    files = [frame.file.replace("\\", "/") for frame in frames]
    if any("/torch/distributed/" in file for file in files[-6:]):
        return "collective", where
    if phase == "data_wait" or any("/torch/utils/data/" in file for file in files):
        return "data_wait", where
    if innermost is None:
        return "compute", where
    inner_file = files[-1]
    if (inner_file.endswith("/threading.py") and innermost.function in _LOCK_FUNCTIONS) or (
        _LOCK_CODE.search(innermost.code)
    ):
        return "lock_wait", where
    if _IO_CODE.search(innermost.code) or any(
        file.endswith("/torch/serialization.py") for file in files
    ):
        return "io", where
    return "compute", where


@dataclass(frozen=True)
class RankEvidence:
    """What one rank said about itself at its last report."""

    rank: int
    stalled: bool
    phase: str
    #: One of :data:`HANG_STATES` while stalled; None when it has not said.
    state: str | None = None
    collectives: int = 0
    where: str = ""
    #: torch's flight recorder (NCCL; gloo too in recent torch): the default group's last
    #: enqueued, started (-1: not timed) and completed collective; None where unavailable.
    flight: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Verdict:
    """The odd rank(s) out of a hung run and why."""

    culprits: tuple[int, ...]
    reason: str
    world: int
    majority_state: str
    message: str


_REASON_BY_STATE = {"data_wait": "data_starvation", "lock_wait": "deadlock", "io": "io"}


def judge(evidence: Sequence[RankEvidence]) -> Verdict | None:
    """The verdict over every known rank of one run, or None when there is none to give.

    Three rules, the first that applies decides:

    - **odd state out**: a strict minority whose state differs from the majority's;
    - **waiting on**: no majority (two ranks, or a tie), but some ranks wait in a
      collective and all the others share one other state: the ones not in the
      collective hold it up (two ranks: one in ``all_reduce``, one in its data loader);
    - **behind**: all wait in collectives (or, with the flight recorder on every rank,
      all compute: NCCL's waiting ranks block in a device sync), and at most half
      issued fewer than the rest (flight recorder sequence numbers when every rank
      has them, else the counted calls): they are behind by a collective.

    A tie of equals (two ranks in the same state, as many collectives) names no one.
    The reason class follows the culprit's state: ``data_wait`` is data starvation,
    ``lock_wait`` a deadlock, ``io`` I/O; a culprit computing while the others wait in
    a collective did not enter it (``collective_not_entered``), else ``compute``.
    """
    world = len(evidence)
    if world < 2 or not all(rank.stalled and rank.state for rank in evidence):
        return None
    found = _culprits(evidence)
    if found is None:
        return None
    culprits, majority, behind = found
    odd_state = str(Counter(rank.state for rank in culprits).most_common(1)[0][0])
    if odd_state in _REASON_BY_STATE:
        reason = _REASON_BY_STATE[odd_state]
    elif majority == "collective" or behind:
        reason = "collective_not_entered"
    else:
        reason = "compute"
    culprits.sort(key=lambda rank: rank.rank)
    return Verdict(
        culprits=tuple(rank.rank for rank in culprits),
        reason=reason,
        world=world,
        majority_state=majority,
        message=_message(culprits, reason, world, majority, evidence),
    )


def _culprits(evidence: Sequence[RankEvidence]) -> tuple[list[RankEvidence], str, bool] | None:
    """The three rules of :func:`judge`: (culprits, the majority's state, whether they are
    behind by a collective), or None when no rule names anyone."""
    world = len(evidence)
    ranked = Counter(rank.state for rank in evidence).most_common()
    majority, size = str(ranked[0][0]), ranked[0][1]
    tie = len(ranked) > 1 and ranked[1][1] == size
    if len(ranked) > 1 and not tie:
        culprits = [rank for rank in evidence if rank.state != majority]
        return None if 2 * len(culprits) >= world else (culprits, majority, False)
    if tie:
        culprits = [rank for rank in evidence if rank.state != "collective"]
        if len(culprits) == world or len({rank.state for rank in culprits}) != 1:
            return None  # nobody waits in a collective, or the others disagree among themselves
        return culprits, "collective", False
    if majority == "collective" or (
        majority == "compute" and all(rank.flight is not None for rank in evidence)
    ):
        # NCCL returns from the call at once: ranks waiting on a peer block later, in a
        # device sync that reads as compute; the flight recorder still says who is behind.
        culprits = _behind(evidence)
        return (culprits, majority, True) if culprits else None
    return None  # every rank in the same state, not a collective: read the stacks


def _behind(evidence: Sequence[RankEvidence]) -> list[RankEvidence]:
    """The ranks behind the others by a collective, when at most half are.

    With the flight recorder on every rank: fewer enqueued, then fewer started. Completed
    sequence numbers are not compared: in a hang the collective the others wait in has
    completed nowhere, and gloo marks completions late (measured: a rank's
    ``last_completed`` lagging its finished calls by two). Without it: fewer calls counted.
    """
    progress: dict[int, tuple[int, ...]] = {}
    for rank in evidence:
        if rank.flight is not None and all(other.flight is not None for other in evidence):
            progress[rank.rank] = (rank.flight[0], rank.flight[1])
        else:
            progress[rank.rank] = (rank.collectives,)
    most = max(progress.values())
    behind = [rank for rank in evidence if progress[rank.rank] < most]
    return behind if 2 * len(behind) <= len(evidence) else []


def _message(
    culprits: Sequence[RankEvidence],
    reason: str,
    world: int,
    majority: str,
    evidence: Sequence[RankEvidence],
) -> str:
    """``rank 2 of 4 stuck in data_wait at loader.py:42 (data_starvation); the other 3 ...``."""
    names = ", ".join(str(rank.rank) for rank in culprits)
    first = culprits[0]
    where = f" at {first.where}" if first.where else ""
    others = [rank for rank in evidence if rank.state == majority]
    other_where = Counter(rank.where for rank in others).most_common(1)[0][0] if others else ""
    plural = "s" if len(culprits) > 1 else ""
    return (
        f"rank{plural} {names} of {world} stuck in {first.state}{where} ({reason}); "
        f"the other {world - len(culprits)} wait in {majority}"
        + (f" at {other_where}" if other_where else "")
    )
