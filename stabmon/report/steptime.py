"""Step time per phase of two runs, on a common footing, for ``stabmon compare``.

Each process writes a ``throughput`` record every ``throughput.record_seconds`` with
its running seconds per phase (docs/throughput.md); between two of them lies a *block*
of steps, and its seconds per step per phase. Both runs are read over the same steps:
after the warm-up (the runs' ``throughput.slowdown_warmup_steps``, at most a quarter
of the shorter run) and up to the last step both reached. A phase's figure is the
median of its blocks' seconds per step, with the 25th and 75th percentiles as its
spread. ``step`` is the four built-in phases together (input wait, forward, backward,
optimizer), end to end; named phases (``eval``, ``checkpoint``) are per training step
too, but not part of a step.

A median *moved* when it changed by ``THRESHOLD`` (10%) or more of run A's, by at least
``MIN_SHARE`` of A's step time (a phase of microseconds that doubles moves nothing), and,
with three blocks or more in each run, the middle halves of the two runs' blocks (25th
to 75th percentile) do not overlap (a noisy machine moves medians too). Runs whose work
per step differs (model FLOPs, batch, tokens, world size) are not compared: the verdict
is "inconclusive" with the reason.
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
#: Fewer blocks than this after warm-up: the run's every block is used, warm-up included.
MIN_BLOCKS = 2
#: With at least this many blocks in each run, a median moved only if the middle halves
#: (25th to 75th percentile) do not overlap.
MIN_SPREAD_BLOCKS = 3
BUILT_IN = ("data_wait", "forward", "backward", "optimizer")
_DEFAULT_WARMUP = 100  # throughput.slowdown_warmup_steps' default


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
    """Step time per phase of ``a_ranks`` against ``b_ranks`` (one rank each, or all)."""
    last = min(a.steps, b.steps) - 1
    warmup = min(max(_warmup(a), _warmup(b)), (last + 1) // 4)
    notes: list[str] = []
    reasons = inconclusive(a, b, a_ranks, b_ranks)
    pooled_a = _blocks(a_ranks, warmup, last, "A", notes)
    pooled_b = _blocks(b_ranks, warmup, last, "B", notes)
    for name, blocks in (("A", pooled_a), ("B", pooled_b)):
        if not any(blocks.values()):
            reasons.append(
                f"run {name} has no throughput record with steps in it (stabmon older than "
                "compare, or it ended before its first step)"
            )
    scopes: list[int | None] = [None]
    if len(a_ranks) > 1 or len(b_ranks) > 1:
        scopes += sorted({r.rank for r in a_ranks} & {r.rank for r in b_ranks})
    rows: list[PhaseRow] = []
    for scope in scopes:
        rows += _rows(scope, pooled_a, pooled_b, judge=not reasons)
    return StepTime(warmup, warmup, last, tuple(reasons), tuple(rows), tuple(notes))


def inconclusive(
    a: RunDigest, b: RunDigest, a_ranks: list[RankDigest], b_ranks: list[RankDigest]
) -> list[str]:
    """Why the runs' step times cannot be compared: their work per step differs."""
    reasons = []
    if a.world_size() != b.world_size():
        reasons.append(f"world size differs (A {a.world_size()}, B {b.world_size()} ranks)")
    pairs = [(x, y) for x in a_ranks for y in b_ranks if x.rank == y.rank]
    checks: tuple[tuple[str, Callable[[RankDigest], float | None], str], ...] = (
        ("batch size differs", lambda r: r.per_step("samples"), "samples per step"),
        ("tokens per step differ", lambda r: r.per_step("tokens"), "tokens per step"),
        ("model FLOPs differ", RankDigest.flops_per_step, "FLOPs per step"),
        ("the model differs", _parameter_tensors, "parameter tensors"),
    )
    for what, read, unit in checks:
        differing = [(x.rank, read(x), read(y)) for x, y in pairs]
        found = [(rank, p, q) for rank, p, q in differing if p is not None and q is not None
                 and not math.isclose(p, q, rel_tol=1e-3)]  # fmt: skip
        if found:
            rank, value_a, value_b = found[0]
            reasons.append(f"{what} (A {_count(value_a)}, B {_count(value_b)} {unit}, rank {rank})")
    return reasons


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


def _blocks(
    ranks: list[RankDigest], first: int, last: int, name: str, notes: list[str]
) -> dict[int, list[Block]]:
    """Each rank's blocks within steps ``first``..``last``; all of them when too few are."""
    found: dict[int, list[Block]] = {}
    for rank in ranks:
        every = rank.blocks()
        inside = [b for b in every if b.first_step >= first and b.last_step <= last]
        if len(inside) < MIN_BLOCKS and every:
            notes.append(
                f"run {name}, rank {rank.rank}: {len(inside)} throughput block(s) in steps "
                f"{first}-{last}, so all {len(every)} are used, warm-up and every step "
                "included (a lower throughput.record_seconds gives more)"
            )
            inside = every
        found[rank.rank] = inside
    return found


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
    if min(a.blocks, b.blocks) >= MIN_SPREAD_BLOCKS and (b.p25 <= a.p75 and a.p25 <= b.p75):
        return None  # the middle halves overlap: noise as likely as a move
    return "slower" if delta > 0 else "faster"


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _count(value: float) -> str:
    """A count as a person reads it: 8,576 and 17,152, not 1.715e+04."""
    return f"{value:,.0f}" if value == int(value) and abs(value) < 1e15 else f"{value:,.4g}"


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
