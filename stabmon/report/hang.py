"""The hang verdict of ``stabmon status``: the odd rank out of each stalled run, from scrapes.

The same judgement the ranks make over their node's records
(:func:`stabmon.detectors.hang.judge`), here over the gauges every rank exports,
so it covers every rank ``stabmon status`` reaches, on any node.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from stabmon.detectors.hang import RankEvidence, judge
from stabmon.report.events import Run
from stabmon.report.status import RankStatus

__all__ = ["STALL_EXIT_CODE", "format_verdicts", "hang_findings"]

#: stabmon.wiring.stall_action.STALL_EXIT_CODE, repeated: the report must not import the
#: monitor side.
STALL_EXIT_CODE = 75


def format_verdicts(statuses: Sequence[RankStatus]) -> list[str]:
    """One line per run with a verdict: ``run r: HANG rank 2 of 4 stuck in data_wait ...``."""
    by_run: dict[str, list[RankEvidence]] = defaultdict(list)
    for status in statuses:
        if status.error is not None or not status.rank.isdigit():
            continue
        by_run[status.run].append(
            RankEvidence(
                rank=int(status.rank),
                stalled=status.stalled,
                phase=status.phase,
                state=status.hang_state,
                collectives=int(status.collectives),
            )
        )
    lines = []
    for run, evidence in sorted(by_run.items()):
        verdict = judge(evidence)
        if verdict is not None:
            lines.append(f"run {run}: HANG {verdict.message}")
    return lines


def hang_findings(run: Run) -> list[str]:
    """``stabmon report`` lines: each distinct hang verdict the ranks wrote, and stall exits."""
    lines: dict[str, None] = {}
    for log in run.ranks:
        for record in log.of("hang_verdict"):
            detail = record.get("detail")
            if isinstance(detail, str):
                lines[f"hang verdict at step {record.get('step')}: {detail}"] = None
    exits = sorted(log.rank for log in run.ranks if log.of("stall_exit"))
    if exits:
        lines[f"stall_action exit: rank(s) {', '.join(map(str, exits))} ended the job "
              f"(status {STALL_EXIT_CODE})"] = None  # fmt: skip
    return list(lines)
