"""The other ranks of this run on this node, read from their registration records.

Design
------
Each rank's heartbeat thread rewrites its record (``<root>/<run>/rank-N.json``)
every ``sample_seconds`` with its loop phase and limit, and its stall responder
adds the hang evidence at once. A rank reads its peers' records for two
judgements, both from the watchdog or responder thread and never the training
thread:

- :meth:`NodePeers.peer_phase`: whether a peer is inside a named phase
  (``checkpoint``, ``eval``) or its start-up, within that phase's own limit.
  The ranks waiting on it (rank 0 saves alone, the others wait in a barrier)
  are not stalled: the watchdog gives them the phase's limit too, so no
  ``stall`` is recorded. Once the peer passes its limit, or (with no peer
  holding) any peer declares a stall, the job is hung, and the waiting ranks are
  judged against their own limits again.
- :meth:`NodePeers.evidence`: every rank's hang evidence, for the node verdict.

Only this run's directory is read, never through a symlink, and only records
that this process's own user wrote: a shared node is hostile, and another
user's record must neither name a culprit nor hold a stall back. Reads are
cached for ``refresh_seconds`` on an injected clock: a stalled rank reads at
most a few small files a second.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from stabmon.contract import STEP_LOOP_PHASES
from stabmon.detectors.hang import RankEvidence
from stabmon.detectors.stall import PeerPhase
from stabmon.shared.rundir import ProcessRecord, read_run_records

__all__ = ["NodePeers", "evidence_of", "peer_phase", "phase_holder"]

#: A peer's reads are reused this long: one directory listing a second at most.
REFRESH_SECONDS = 1.0


def evidence_of(record: ProcessRecord) -> RankEvidence:
    """One record's hang evidence (an exited rank is not stalled)."""
    return RankEvidence(
        rank=record.rank,
        stalled=record.hang_state is not None and record.exited_unix is None,
        phase=record.phase or "",
        state=record.hang_state,
        collectives=record.collectives,
        where=record.hang_where or "",
        flight=record.flight,
    )


def phase_holder(
    records: Sequence[ProcessRecord], *, rank: int, now_unix: float
) -> ProcessRecord | None:
    """A peer inside a named phase (or its start-up) and within that phase's limit, if any.

    The peer's silence is counted from its last completed step (or its attach),
    which is at or before its phase began: the holder is let go no later than its
    own watchdog would declare it stalled.
    """
    for record in records:
        if record.rank == rank or record.exited_unix is not None or record.hang_state:
            continue
        if (
            record.phase is None
            or record.phase in STEP_LOOP_PHASES
            or record.stall_limit_seconds is None
        ):
            continue  # a step-loop phase: its limit is the step limit, nothing to wait for
        since = record.last_step_unix if record.last_step_unix is not None else record.attached_unix
        if 0.0 <= now_unix - since < record.stall_limit_seconds:
            return record
    return None


def peer_phase(records: Sequence[ProcessRecord], *, rank: int, now_unix: float) -> PeerPhase:
    """HOLDING if a peer holds a named phase (:func:`phase_holder`), else STALLED if a peer
    has declared a stall or is in a named phase past its limit, else NONE."""
    if phase_holder(records, rank=rank, now_unix=now_unix) is not None:
        return PeerPhase.HOLDING
    for record in records:
        if record.rank == rank or record.exited_unix is not None:
            continue
        named = record.phase is not None and record.phase not in STEP_LOOP_PHASES
        if record.hang_state or (named and record.stall_limit_seconds is not None):
            return PeerPhase.STALLED  # in a named phase that no longer holds: past its limit
    return PeerPhase.NONE


class NodePeers:
    """The records of one run on this node that this user wrote, read lazily and cached."""

    def __init__(
        self,
        run_directory: Path,
        *,
        run: str,
        rank: int,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        refresh_seconds: float = REFRESH_SECONDS,
        uid: int | None = None,
    ) -> None:
        self._run_directory = run_directory
        self._run = run
        self._rank = rank
        self._clock = clock
        self._wall_clock = wall_clock
        self._refresh = refresh_seconds
        self._uid = os.geteuid() if uid is None else uid
        self._read_at: float | None = None
        self._records: list[ProcessRecord] = []

    def records(self, *, fresh: bool = False) -> list[ProcessRecord]:
        """This run's records on this node written by our own user (cached unless ``fresh``)."""
        now = self._clock()
        if fresh or self._read_at is None or now - self._read_at >= self._refresh:
            owned, _ = read_run_records(self._run_directory)
            # The ranks of one job run as one user; another local user's record is not evidence.
            self._records = [
                item.record
                for item in owned
                if item.owner_uid == self._uid and item.record.run == self._run
            ]
            self._read_at = now
        return self._records

    def phase_holder(self) -> ProcessRecord | None:
        """See :func:`phase_holder`."""
        return phase_holder(self.records(), rank=self._rank, now_unix=self._wall_clock())

    def peer_phase(self) -> PeerPhase:
        """See :func:`peer_phase`; the watchdog asks once half its own limit has passed."""
        return peer_phase(self.records(), rank=self._rank, now_unix=self._wall_clock())

    def evidence(self) -> list[RankEvidence]:
        """Every rank's hang evidence, read now (a verdict must not be a second old)."""
        return [evidence_of(record) for record in self.records(fresh=True)]
