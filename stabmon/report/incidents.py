"""Where a fault came from, across ranks: the rank that went non-finite first, each rank's
NaN provenance verdict, the batches an incident trained on, and the replicas that diverged
(silent data corruption: the rank outvoted, its host and GPU), from the event logs.

In data parallel training every replica's gradients turn non-finite in the same step (the
all-reduce spreads them), so "first" is the rank whose own forward produced it: of the
ranks non-finite at the earliest step, one whose loss was non-finite there (its own
forward), else one whose provenance names a forward producer, else the lowest.
"""

from __future__ import annotations

from html import escape
from typing import Any

from stabmon.report.events import Run, count

__all__ = ["first_nonfinite_rank", "incidents_section", "replica_mismatches"]

_NONFINITE = frozenset({"nonfinite_grad", "nonfinite_loss"})
#: Batches shown per incident at most (the skip file holds them all).
_BATCHES_SHOWN = 8


def first_nonfinite_rank(run: Run) -> tuple[int, int] | None:
    """``(rank, step)`` of the rank that went non-finite first, or None without a NaN."""
    firsts: dict[int, tuple[int, bool]] = {}  # rank -> (first step, its loss was non-finite)
    for log in run.ranks:
        found = [
            (step, record.get("kind") == "nonfinite_loss")
            for record in log.of("anomaly")
            if record.get("kind") in _NONFINITE and (step := count(record.get("step"))) is not None
        ]
        if found:
            first = min(step for step, _ in found)
            firsts[log.rank] = (first, any(loss for step, loss in found if step == first))
    if not firsts:
        return None
    earliest = min(step for step, _ in firsts.values())
    candidates = sorted(rank for rank, (step, _) in firsts.items() if step == earliest)
    producers = {
        log.rank
        for log in run.ranks
        for record in log.of("provenance")
        if record.get("direction") == "forward" and count(record.get("step")) == earliest
    }
    chosen = next(
        (rank for rank in candidates if firsts[rank][1]),
        next((rank for rank in candidates if rank in producers), candidates[0]),
    )
    return chosen, earliest


def incidents_section(run: Run) -> str:
    """The report's section: first rank, provenance verdicts, batches of each incident."""
    first = first_nonfinite_rank(run)
    verdicts = [(log.rank, r) for log in run.ranks for r in log.of("provenance")]
    batches = [(log.rank, r) for log in run.ranks for r in log.of("batch_identities")]
    replicas = replica_mismatches(run)
    if first is None and not verdicts and not batches and not replicas:
        return ""
    parts = ['<section id="incidents"><h2>Where faults came from</h2>']
    if first is not None:
        parts.append(
            f"<p>First non-finite: rank {first[0]} at step {first[1]} (of "
            f"{len(run.ranks)} rank(s)).</p>"
        )
    if verdicts:
        rows = "".join(_verdict_row(rank, record) for rank, record in verdicts)
        parts.append(
            '<table><tr><th class="num">step</th><th class="num">rank</th><th>producer</th>'
            f"<th>pass</th><th>passed on by</th></tr>{rows}</table>"
        )
    if batches:
        rows = "".join(_batches_row(rank, record) for rank, record in batches)
        parts.append(
            '<table><tr><th class="num">step</th><th class="num">rank</th><th>kind</th>'
            f"<th>batches (step: indices, ids or sample hashes)</th></tr>{rows}</table>"
            "<p>The same batches are in each rank's <code>rank-N.skip_batches.json</code>, "
            "ready for a loop to skip them on resume (docs/loops.md).</p>"
        )
    if replicas:
        rows = "".join(_replica_row(record) for record in replicas[:_BATCHES_SHOWN])
        parts.append(
            '<table><tr><th class="num">step</th><th>replicas differ in</th>'
            f"<th>outvoted rank (host GPU, first group)</th></tr>{rows}</table>"
            "<p>Replicas that differ hold a silently corrupted state: resume from a checkpoint "
            "saved at or before the check before that step (the replicas may have parted at any "
            "step in between) and drain the outvoted rank's node "
            "(docs/runbooks.md#stabmonreplicamismatch).</p>"
        )
    parts.append("</section>")
    return "".join(parts)


def replica_mismatches(run: Run) -> list[dict[str, Any]]:
    """One ``replica_mismatch`` record per step (every rank of the group writes the same)."""
    by_step: dict[int, dict[str, Any]] = {}
    for log in run.ranks:
        for record in log.of("anomaly"):
            step = count(record.get("step"))
            if record.get("kind") == "replica_mismatch" and step is not None:
                by_step.setdefault(step, record)
    return [by_step[step] for step in sorted(by_step)]


def _replica_row(record: dict[str, Any]) -> str:
    groups = record.get("groups")
    listed = ", ".join(map(str, groups)) if isinstance(groups, list) else ""
    culprits = record.get("culprits")
    named = "; ".join(
        f"rank {entry.get('rank')} ({entry.get('where') or 'host unknown'}, {entry.get('group')})"
        for entry in (culprits if isinstance(culprits, list) else [])
        if isinstance(entry, dict)
    )
    return (
        f'<tr><td class="num">{escape(str(record.get("step")))}</td><td>{escape(listed)}</td>'
        f"<td>{escape(named or 'none named: no majority (two replicas)')}</td></tr>"
    )


def _verdict_row(rank: int, record: dict[str, Any]) -> str:
    producer = record.get("producer")
    shown = "not reproduced: a transient" if producer is None else str(producer)
    propagators = record.get("propagators")
    passed = ", ".join(map(str, propagators)) if isinstance(propagators, list) else ""
    return (
        f'<tr><td class="num">{escape(str(record.get("step")))}</td>'
        f'<td class="num">{rank}</td><td>{escape(shown)}</td>'
        f"<td>{escape(str(record.get('direction') or ''))}</td><td>{escape(passed)}</td></tr>"
    )


def _batches_row(rank: int, record: dict[str, Any]) -> str:
    listed = record.get("batches")
    entries = listed if isinstance(listed, list) else []
    shown = "; ".join(
        f"{entry.get('step')}: {entry.get('indices', entry.get('ids', entry.get('hashes')))}"
        for entry in entries[:_BATCHES_SHOWN]
        if isinstance(entry, dict)
    )
    return (
        f'<tr><td class="num">{escape(str(record.get("step")))}</td>'
        f'<td class="num">{rank}</td><td>{escape(str(record.get("kind")))}</td>'
        f"<td>{escape(shown)}</td></tr>"
    )
