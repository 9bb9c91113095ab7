"""Plug-in: the replica check's verdict. stabmon.probes.replicas fingerprints the
data-parallel replicas' parameters, gathers and votes on the device (no sync); this judges
the vote read back a step later and says, in the words a user reads, which rank diverged,
where it runs, in which module group, and what to do (silent data corruption)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stabmon.contract import REPLICA_CHECKS, REPLICA_MISMATCHES
from stabmon.extension import Context, Reading

__all__ = [
    "KIND", "OUTLIER_KIND", "GradOutlier", "ReplicaCheck", "ReplicaVerdict",
    "grad_outliers", "mismatch_message", "outlier_message",
]  # fmt: skip

KIND = "replica_mismatch"
#: The weaker signal: a rank whose gradient before the all-reduce stood out (local norms).
OUTLIER_KIND = "replica_grad_outlier"
#: How far above the replicas' median a rank's largest local gradient norm over a check's
#: interval must be to be named. Healthy replicas' maxima over the same steps differ by a
#: few times at most (their batches differ); a corrupted value, by orders of magnitude.
OUTLIER_RATIO = 100.0

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


@dataclass(frozen=True)
class GradOutlier:
    """A check whose ranks' local (pre-reduce) gradient norms name one or a few outliers."""

    step: int
    outliers: dict[int, float]  # rank -> its largest local norm over the interval
    median: float  # the replicas' median of those maxima
    replicas: int
    how: str
    every: int


def grad_outliers(
    ranks: Sequence[int], norms: Sequence[float], step: int, how: str, every: int
) -> GradOutlier | None:
    """The ranks whose interval-maximum local gradient norm is non-finite while most are
    finite, or :data:`OUTLIER_RATIO` times the median or more; None when none stands out or
    too few replicas to say (a median of two is either one)."""
    finite = sorted(n for n in norms if math.isfinite(n))
    if len(norms) < 3 or len(finite) * 2 <= len(norms) or not finite:
        return None
    median = finite[len(finite) // 2]
    outliers = {
        rank: norm
        for rank, norm in zip(ranks, norms, strict=True)
        if not math.isfinite(norm) or (median > 0 and norm >= OUTLIER_RATIO * median)
    }
    if not outliers or len(outliers) * 2 >= len(norms):
        return None
    return GradOutlier(step, outliers, median, len(norms), how, every)


def outlier_message(found: GradOutlier, rank: int, where: dict[int, str]) -> str:
    """The log line of a local-norm outlier: who, by how much, what it may be, what to do."""
    named = "; ".join(
        f"rank {culprit} ({where.get(culprit, 'host unknown')}): {norm:.3g}"
        for culprit, norm in sorted(found.outliers.items())
    )
    return (
        f"rank {rank}: a data-parallel rank's own gradient, before the all-reduce, stood far "
        f"out from the other replicas' in the {found.every} step(s) up to step {found.step} "
        f"(largest local gradient norm; the replicas' median {found.median:.3g}): {named}. "
        "A weaker signal than a parameter mismatch: a GPU computing wrong gradients "
        "corrupts the average every replica applies (their parameters stay identical), and "
        "a batch far outside the others' on that rank looks the same. Look at that rank's "
        f"loss over steps {found.step - found.every + 1}..{found.step} (a batch's own spike "
        "shows there, and its batches are named at that spike); if it is ordinary, stop "
        "before the next checkpoint save and drain that node (`dcgmi diag -r 3`)"
    )


class Probe(Protocol):
    """What the check measures with (``stabmon.probes.replicas.ReplicaProbe``)."""

    ranks: tuple[int, ...]
    how: str
    group_names: list[str]
    where: list[str]

    @property
    def local_norms(self) -> object | None:
        """The local-norm state when replica_local_norms is on (its values follow the vote)."""

    def measure(self, step: int) -> Any: ...


def verdict_of(probe: Probe, step: int, values: Sequence[float]) -> ReplicaVerdict | None:
    """Read :func:`stabmon.probes.fingerprint.vote`'s flat output; None if malformed."""
    size, buckets = len(probe.ranks), len(probe.group_names)
    majority_at, culprit_at, end = buckets, 2 * buckets, 2 * buckets + size
    if len(values) != end + (size if probe.local_norms is not None else 0):
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
        if self._probe.local_norms is not None:
            norms = values[len(values) - verdict.replicas :]
            self._judge_local_norms(verdict, norms)
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

    def _judge_local_norms(self, verdict: ReplicaVerdict, norms: Sequence[float]) -> None:
        found = grad_outliers(self._probe.ranks, norms, verdict.step, verdict.how, verdict.every)
        if found is None:
            return
        self._context.anomaly(
            OUTLIER_KIND, verdict.step,
            outlier_message(found, self._context.rank, verdict.where),
            culprit_ranks=sorted(found.outliers), replicas=found.replicas,
            local_grad_norms={str(r): n for r, n in sorted(found.outliers.items())},
            median_local_grad_norm=found.median,
        )  # fmt: skip

    def detach(self) -> None:
        """Monitor.detach(): the local-norm hook, which DDP cannot take back, measures nothing
        more (it goes on reducing exactly as DDP does without one)."""
        close = getattr(self._probe.local_norms, "close", None)
        if close is not None:
            close()

    def readings(self) -> Iterator[Reading]:
        yield REPLICA_CHECKS, [((), float(self.checks))]
        yield REPLICA_MISMATCHES, [((), float(self.mismatches))]
