"""Step time per phase of two runs, on a common footing, for ``stabmon compare``.

Each process writes a ``throughput`` record every ``throughput.record_seconds`` with
its running seconds per phase (docs/throughput.md); between two of them lies a *block*
of steps, and its seconds per step per phase. Both runs are read over the same steps:
after the warm-up (the runs' ``throughput.slowdown_warmup_steps``, at most a quarter
of the shorter run) and up to the last step both reached; only blocks wholly inside
count. A phase's figure is the median of its blocks' seconds per step, with the 25th
and 75th percentiles as its spread. ``step`` is the four built-in phases together
(input wait, forward, backward, optimizer), end to end; named phases (``eval``,
``checkpoint``) are per training step too, but not part of a step.

A median *moved* when it changed by ``THRESHOLD`` (10%) or more of run A's, by at least
``MIN_SHARE`` of A's step time (a phase of microseconds that doubles moves nothing), and
the middle halves of the two runs' blocks (25th to 75th percentile) lie apart by at
least ``MIN_GAP`` of A's median (a machine busier in one run than the other moves
medians too). The comparison is inconclusive, with the reason, when a rank has fewer
than ``MIN_BLOCKS`` blocks in the steps compared (a median of one or two blocks is
noise), or when the runs' work per step differs: world size, model FLOPs, parameter
tensors, or samples or tokens per step over the steps compared by more than
``WORK_TOLERANCE`` (a short last batch per epoch moves the mean a little).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from stabmon.report.digest import Block, RankDigest, RunDigest

__all__ = ["THRESHOLD", "PhaseRow", "Spread", "StepTime", "compare_step_time"]

THRESHOLD = 0.10
MIN_SHARE = 0.02
#: Blocks each rank needs in the steps compared for its step time to be judged.
MIN_BLOCKS = 4
#: How far apart (share of A's median) the two runs' middle halves must lie to have moved.
MIN_GAP = 0.05
#: Work per step (samples, tokens) within this share is the same work: 5% more samples
#: cannot by itself move the step time by the 10% a verdict needs.
WORK_TOLERANCE = THRESHOLD / 2
BUILT_IN = ("data_wait", "forward", "backward", "optimizer")
_DEFAULT_WARMUP = 100  # throughput.slowdown_warmup_steps' default
#: Each rank's blocks in the steps compared.
_ByRank = dict[int, list[Block]]
#: A figure of one rank's work per step, read from the rank or its blocks.
_Reader = Callable[[RankDigest, _ByRank], float | None]


@dataclass(frozen=True)
class Spread:
    """Median and quartiles of seconds per step over ``blocks`` blocks."""

    median: float
    p25: float
    p75: float
    blocks: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        if not values:
            return None
        ordered = sorted(values)
        return cls(
            _quantile(ordered, 0.5),
            _quantile(ordered, 0.25),
            _quantile(ordered, 0.75),
            len(ordered),
        )

    def to_json(self) -> dict[str, Any]:
        return {"median": self.median, "p25": self.p25, "p75": self.p75, "blocks": self.blocks}


@dataclass(frozen=True)
class PhaseRow:
    """One phase of one rank (``rank`` None: every rank pooled) in both runs."""

    rank: int | None
    phase: str
    a: Spread | None
    b: Spread | None
    #: "slower" or "faster" when the median moved (see the module's docstring), else None.
    moved: str | None = None

    @property
    def delta(self) -> float | None:
        """B's median minus A's, seconds per step."""
        return None if self.a is None or self.b is None else self.b.median - self.a.median

    @property
    def change(self) -> float | None:
        """The delta relative to A's median; None when A's is 0 or either is missing."""
        delta = self.delta
        if delta is None or self.a is None or self.a.median <= 0:
            return None
        return delta / self.a.median

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "phase": self.phase,
            "a": self.a.to_json() if self.a else None,
            "b": self.b.to_json() if self.b else None,
            "delta_seconds": self.delta,
            "change": self.change,
            "moved": self.moved,
        }


@dataclass(frozen=True)
class StepTime:
    """The step-time comparison: which steps, whether comparable, and the rows."""

    warmup_steps: int
    first_step: int
    last_step: int
    reasons: tuple[str, ...]
    rows: tuple[PhaseRow, ...]
    notes: tuple[str, ...]

    @property
    def comparable(self) -> bool:
        return not self.reasons

    def whole(self) -> list[PhaseRow]:
        """The rows of the whole run (every rank pooled)."""
        return [row for row in self.rows if row.rank is None]

    def moved_most(self, rank: int | None = None) -> PhaseRow | None:
        """The phase whose median moved most in seconds per step (not ``step`` itself)."""
        rows = [r for r in self.rows if r.rank == rank and r.phase != "step" and r.delta]
        return max(rows, key=lambda row: abs(row.delta or 0.0), default=None)

    def to_json(self) -> dict[str, Any]:
        moved = self.comparable and any(row.moved for row in self.whole())
        most = self.moved_most() if moved else None
        return {
            "warmup_steps": self.warmup_steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "comparable": self.comparable,
            "inconclusive_reasons": list(self.reasons),
            "moved_most": most.phase if most is not None else None,
            "rows": [row.to_json() for row in self.rows],
            "notes": list(self.notes),
        }


def compare_step_time(
    a: RunDigest, b: RunDigest, a_ranks: list[RankDigest], b_ranks: list[RankDigest]
) -> StepTime:
    """Step time per phase of ``a_ranks`` against ``b_ranks`` (one rank each, or all).

    The whole run's rows pool the ranks both runs have; a rank only one run has is left
    out of them (compare's notes say so).
    """
    last = min(a.steps, b.steps) - 1
    warmup = min(max(_warmup(a), _warmup(b)), (last + 1) // 4)
    common = {r.rank for r in a_ranks} & {r.rank for r in b_ranks}
    pooled_a = _blocks([r for r in a_ranks if r.rank in common], warmup, last)
    pooled_b = _blocks([r for r in b_ranks if r.rank in common], warmup, last)
    reasons = inconclusive(a, b, a_ranks, b_ranks, (pooled_a, pooled_b))
    for name, ranks in (("A", a_ranks), ("B", b_ranks)):
        if not any(rank.blocks() for rank in ranks):
            reasons.append(
                f"run {name} has no throughput record with steps in it (stabmon older than "
                "compare, or it ended before its first step)"
            )
    sides = (("A", pooled_a), ("B", pooled_b))
    few = [f"{name} rank {rank}: {len(found)}" for name, pooled in sides
           for rank, found in sorted(pooled.items()) if len(found) < MIN_BLOCKS]  # fmt: skip
    if few and not any("no throughput record" in reason for reason in reasons):
        reasons.append(
            f"too few blocks to compare step time ({', '.join(few)} in steps {warmup}-{last}; "
            f"{MIN_BLOCKS} needed); set throughput.record_seconds lower or run longer"
        )
    scopes: list[int | None] = [None]
    if len(a_ranks) > 1 or len(b_ranks) > 1:
        scopes += sorted(common)
    rows: list[PhaseRow] = []
    for scope in scopes:
        rows += _rows(scope, pooled_a, pooled_b, judge=not reasons)
    return StepTime(warmup, warmup, last, tuple(reasons), tuple(rows), ())


def inconclusive(
    a: RunDigest,
    b: RunDigest,
    a_ranks: list[RankDigest],
    b_ranks: list[RankDigest],
    blocks: tuple[_ByRank, _ByRank],
) -> list[str]:
    """Why the runs' step times cannot be compared: their work per step differs.

    ``blocks`` are each run's blocks by rank in the steps compared, whose samples and
    tokens per step are compared (not the whole run's: a short last batch, or steps past
    the other run's end, move a whole run's mean)."""
    reasons = []
    if a.world_size() != b.world_size():
        reasons.append(f"world size differs (A {a.world_size()}, B {b.world_size()} ranks)")
    pairs = [(x, y) for x in a_ranks for y in b_ranks if x.rank == y.rank]
    checks: tuple[tuple[str, _Reader, str, float], ...] = (
        ("batch size differs", _per_step("samples"), "samples per step", WORK_TOLERANCE),
        ("tokens per step differ", _per_step("tokens"), "tokens per step", WORK_TOLERANCE),
        ("model FLOPs differ", lambda r, _: r.flops_per_step(), "FLOPs per step", 1e-3),
        ("the model differs", lambda r, _: _parameter_tensors(r), "parameter tensors", 1e-3),
    )  # fmt: skip
    for what, read, unit, tolerance in checks:
        differing = [(x.rank, read(x, blocks[0]), read(y, blocks[1])) for x, y in pairs]
        found = [(rank, p, q) for rank, p, q in differing if p is not None and q is not None
                 and not math.isclose(p, q, rel_tol=tolerance)]  # fmt: skip
        if found:
            rank, value_a, value_b = found[0]
            reasons.append(f"{what} (A {_count(value_a)}, B {_count(value_b)} {unit}, rank {rank})")
    return reasons


def _per_step(what: str) -> _Reader:
    """Samples or tokens (``what``) per step over a rank's blocks, when they were counted."""

    def read(rank: RankDigest, blocks: _ByRank) -> float | None:
        counted = [(getattr(b, what), b.steps) for b in blocks.get(rank.rank, [])]
        counted = [(done, steps) for done, steps in counted if done is not None]
        steps = sum(steps for _, steps in counted)
        return sum(done for done, _ in counted) / steps if steps else None

    return read


def _parameter_tensors(rank: RankDigest) -> float | None:
    return _number(rank.log.attach.get("parameters"))


def _warmup(run: RunDigest) -> int:
    for rank in run.ranks:
        throughput = rank.log.config.get("throughput")
        if isinstance(throughput, dict):
            value = throughput.get("slowdown_warmup_steps")
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    return _DEFAULT_WARMUP


def _blocks(ranks: list[RankDigest], first: int, last: int) -> _ByRank:
    """Each rank's blocks wholly within steps ``first``..``last``."""
    return {
        rank.rank: [b for b in rank.blocks() if b.first_step >= first and b.last_step <= last]
        for rank in ranks
    }


def _rows(
    scope: int | None, a: dict[int, list[Block]], b: dict[int, list[Block]], *, judge: bool
) -> list[PhaseRow]:
    blocks_a = [x for rank, found in a.items() if scope in (None, rank) for x in found]
    blocks_b = [x for rank, found in b.items() if scope in (None, rank) for x in found]
    named = sorted({p for x in (*blocks_a, *blocks_b) for p in x.per_step} - set(BUILT_IN))
    rows = []
    step_a = Spread.of([x.step_seconds for x in blocks_a])
    for phase in ("step", *BUILT_IN, *named):
        spread_a, spread_b = (
            Spread.of(
                [x.step_seconds if phase == "step" else x.per_step.get(phase, 0.0) for x in blocks]
            )
            for blocks in (blocks_a, blocks_b)
        )
        row = PhaseRow(scope, phase, spread_a, spread_b)
        if judge:
            row = replace(row, moved=_moved(row, step_a.median if step_a else 0.0))
        rows.append(row)
    return rows


def _moved(row: PhaseRow, step_median: float) -> str | None:
    a, b, delta = row.a, row.b, row.delta
    if a is None or b is None or delta is None or abs(delta) < MIN_SHARE * step_median:
        return None
    if a.median > 0 and abs(delta) < THRESHOLD * a.median:
        return None
    gap = b.p25 - a.p75 if delta > 0 else a.p25 - b.p75
    if gap < MIN_GAP * a.median:
        return None  # the middle halves overlap or touch: noise as likely as a move
    return "slower" if delta > 0 else "faster"


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _count(value: float) -> str:
    """A count as a person reads it: 8,576 and 17,152, not 1.715e+04."""
    whole = math.isfinite(value) and value.is_integer() and abs(value) < 1e15
    return f"{value:,.0f}" if whole else f"{value:,.4g}"


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
