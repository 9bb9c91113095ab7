"""The daemon's node view of a hang: which rank of each run on this node holds the others up.

Design
------
Every stalled rank writes its hang evidence (state, innermost frame, collectives
issued) into its registration record (:mod:`stabmon.wiring.stall_action`). After each
process poll, :meth:`NodeHangJudge.update` groups the samples the process table
believes (the record's file owned by the uid running the process, its start time
matching, this boot: :mod:`stabmon.daemon.processes`) by run *and* by that uid,
and judges each group with :func:`stabmon.detectors.hang.judge`, the same pure
function the ranks and ``stabmon status`` use. Grouping by uid keeps another
local user's record, even for the same run id, out of a run's verdict: on a
shared node a record names a culprit only among its own user's ranks. The
exported series carry only ``run``, though, so a run id seen under more than
one uid on the node gets no verdict at all (logged once while it lasts): else
another user could register ranks of their own under a victim's run id and
have the daemon name culprits in the victim's run.

A new verdict is logged once (``stabmon daemon: hang verdict ...``) and exported
as ``stabmon_node_hang_verdict{rank,run,reason}`` until the run recovers; the
collector reads the last poll's verdicts, never the disk. No torch here: the
daemon judges what the ranks wrote.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from stabmon.contract import NODE_HANG_VERDICT
from stabmon.daemon.processes import ProcessSample
from stabmon.detectors.hang import RankEvidence, Verdict, judge
from stabmon.export.families import family
from stabmon.shared.log import LogLimiter
from stabmon.wiring.node_peers import evidence_of

__all__ = ["NodeHangCollector", "NodeHangJudge"]

LOGGER = logging.getLogger("stabmon")

#: Runs judged per poll at most: the process table is bounded already; this is a second fence.
MAX_RUNS = 256


class NodeHangJudge:
    """Judges each run of this node after every process poll (the processes thread)."""

    def __init__(self, *, limiter: LogLimiter) -> None:
        self._limiter = limiter
        #: (run, uid) -> the verdict of the last poll; replaced whole, read by the collector.
        self._verdicts: dict[tuple[str, int], Verdict] = {}
        #: Run ids seen under more than one uid at the last poll (each logged once).
        self._shared: set[str] = set()

    def update(self, samples: Sequence[ProcessSample]) -> dict[tuple[str, int], Verdict]:
        groups: dict[tuple[str, int], list[RankEvidence]] = defaultdict(list)
        for sample in samples:
            if sample.uid is None:
                continue  # not believed: who runs it is unknown
            key = (sample.record.run, sample.uid)
            if key not in groups and len(groups) >= MAX_RUNS:
                continue
            evidence = evidence_of(sample.record)
            if not sample.alive:  # a dead rank is the process-down alert's, not a hang's
                evidence = RankEvidence(rank=evidence.rank, stalled=False, phase=evidence.phase)
            groups[key].append(evidence)
        uids: dict[str, set[int]] = defaultdict(set)
        for run, uid in groups:
            uids[run].add(uid)
        shared = {run for run, users in uids.items() if len(users) > 1}
        for run in sorted(shared - self._shared):
            LOGGER.warning(
                "stabmon daemon: run id %s is registered by %d local users on this node; no "
                "hang verdict is exported for it (its series name only the run, and one user "
                "could name culprits in another's run). Give each job its own run id.",
                run,
                len(uids[run]),
            )
        self._shared = shared
        verdicts: dict[tuple[str, int], Verdict] = {}
        for key, ranks in groups.items():
            if key[0] in shared:
                continue
            verdict = judge(ranks)
            if verdict is None:
                continue
            verdicts[key] = verdict
            previous = self._verdicts.get(key)
            if previous is None or previous.message != verdict.message:
                self._limiter.limited(
                    f"hang:{key[0]}:{key[1]}",
                    logging.ERROR,
                    "stabmon daemon: hang verdict for run %s: %s",
                    key[0],
                    verdict.message,
                )
        self._verdicts = verdicts
        return dict(verdicts)

    def verdicts(self) -> dict[tuple[str, int], Verdict]:
        return dict(self._verdicts)


class NodeHangCollector(Collector):
    """``stabmon_node_hang_verdict``: 1 per culprit rank of each judged run of this node."""

    def __init__(self, judge_: NodeHangJudge) -> None:
        self._judge = judge_

    def collect(self) -> Iterator[Metric]:
        rows = [
            ([str(rank), run, verdict.reason], 1.0)
            for (run, _), verdict in sorted(self._judge.verdicts().items())
            for rank in verdict.culprits
        ]
        yield family(NODE_HANG_VERDICT, rows)
