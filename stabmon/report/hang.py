"""The hang verdict of ``stabmon status``: the odd rank out of each stalled run, from scrapes.

The same judgement the ranks make over their node's records
(:func:`stabmon.detectors.hang.judge`), here over the gauges every rank exports,
so it covers every rank ``stabmon status`` reaches, on any node.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from stabmon.detectors.hang import RankEvidence, judge
from stabmon.report.status import RankStatus

__all__ = ["format_verdicts"]


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
