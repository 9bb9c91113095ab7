"""Plug-in: the replica check's verdict. stabmon.probes.replicas fingerprints the
data-parallel replicas' parameters, gathers and votes on the device (no sync); this judges
the vote read back a step later and says, in the words a user reads, which rank diverged,
where it runs, in which module group, and what to do (silent data corruption)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stabmon.contract import REPLICA_CHECKS, REPLICA_MISMATCHES
from stabmon.extension import Context, Reading

__all__ = ["KIND", "ReplicaCheck", "ReplicaVerdict", "mismatch_message"]

KIND = "replica_mismatch"

#: What to do, in every message: never write the corrupted state, take the GPU out.
WHAT_TO_DO = (
    "stop before the next checkpoint save so the corrupted state is never written, resume "
    "from the last checkpoint saved at or before step {clean} ({why}), and drain that node "
    "(run the GPU's diagnostics, e.g. `dcgmi diag -r 3`) before it trains again"
)


@dataclass(frozen=True)
class ReplicaVerdict:
    """One check's outcome: the module groups that differ and the ranks outvoted in them."""

    step: int
    groups: list[str]  # module groups in which the replicas disagree (empty: all agree)
    majority: bool  # whether a strict majority agreed in each of them
    culprits: dict[int, str] = field(default_factory=dict)  # rank -> its first differing group
    where: dict[int, str] = field(default_factory=dict)  # rank -> "host GPU-uuid"
    replicas: int = 0
    how: str = ""
    every: int = 1  # optimizer steps between checks: the replicas agreed `every` steps before


def mismatch_message(verdict: ReplicaVerdict, rank: int) -> str:
    """The log line and record message of a mismatch: where, which rank, what to do."""
    step = verdict.step
    groups = ", ".join(verdict.groups[:5]) + (" ..." if len(verdict.groups) > 5 else "")
    head = (
        f"rank {rank}: data-parallel replicas ({verdict.replicas}, {verdict.how}) hold "
        f"different parameters after step {step} in module group(s) {groups}"
    )
    if verdict.culprits:
        named = "; ".join(
            f"rank {culprit} ({verdict.where.get(culprit, 'host unknown')}, first in {group})"
            for culprit, group in sorted(verdict.culprits.items())
        )
        who = f": outvoted by the other replicas: {named}, silent data corruption on that GPU"
    elif not verdict.majority:
        who = (
            ": no majority agrees, so no culprit can be named (with two replicas, either "
            "one may be wrong)"
        )
    else:
        who = ""
    clean = step - max(verdict.every, 1)
    why = (
        "the check before this one: the replicas may have parted at any step since"
        if verdict.every > 1
        else "the step before this check"
    )
    return f"{head}{who}; {WHAT_TO_DO.format(clean=clean, why=why)}"


class Probe(Protocol):
    """What the check measures with (``stabmon.probes.replicas.ReplicaProbe``)."""

    ranks: tuple[int, ...]
    how: str
    group_names: list[str]
    where: list[str]

    def measure(self, step: int) -> Any: ...


def verdict_of(probe: Probe, step: int, values: Sequence[float]) -> ReplicaVerdict | None:
    """Read :func:`stabmon.probes.fingerprint.vote`'s flat output; None if malformed."""
    size, buckets = len(probe.ranks), len(probe.group_names)
    majority_at, culprit_at, end = buckets, 2 * buckets, 2 * buckets + size
    if len(values) != end:
        return None
    mismatch, majority = values[:buckets], values[majority_at:culprit_at]
    return ReplicaVerdict(
        step=step,
        groups=[name for name, flag in zip(probe.group_names, mismatch, strict=True) if flag],
        majority=all(agreed for agreed, bad in zip(majority, mismatch, strict=True) if bad),
        culprits={
            probe.ranks[member]: probe.group_names[int(first) - 1]
            for member, first in enumerate(values[culprit_at:end])
            if 0 < first <= buckets
        },
        where=dict(zip(probe.ranks, probe.where, strict=False)),
        replicas=size,
        how=probe.how,
        every=int(getattr(probe, "every", 1)),
    )


class ReplicaCheck:
    """Plug-in: measures through its probe after the step, judges the vote read back."""

    component = "detectors"
    measure_at = "after_step"

    def __init__(self, probe: Probe, context: Context) -> None:
        self._probe = probe
        self._context = context
        self.measure = probe.measure
        self.checks = 0
        self.mismatches = 0

    def judge(self, step: int, values: list[float]) -> None:
        verdict = verdict_of(self._probe, step, values)
        if verdict is None:
            return
        self.checks += 1
        if not verdict.groups:
            return
        self.mismatches += 1
        self._context.anomaly(
            KIND, step, mismatch_message(verdict, self._context.rank),
            culprit_ranks=sorted(verdict.culprits), groups=verdict.groups,
            first_group=verdict.groups[0], replicas=verdict.replicas,
            culprits=[{"rank": rank, "group": group, "where": verdict.where.get(rank, "")}
                      for rank, group in sorted(verdict.culprits.items())],
        )  # fmt: skip

    def readings(self) -> Iterator[Reading]:
        yield REPLICA_CHECKS, [((), float(self.checks))]
        yield REPLICA_MISMATCHES, [((), float(self.mismatches))]
