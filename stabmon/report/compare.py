"""``stabmon compare A B``: why is this run slower, bigger or noisier than that one.

Two run directories are read as :mod:`stabmon.report.digest` reads them (event logs
and records only, no live process) and set side by side:

- the environment, only where it differs (versions, driver, GPUs, host, variables);
- step time per phase on a common footing (:mod:`stabmon.report.steptime`);
- throughput, memory, AMP, anomalies by kind with their steps, and goodput shares.

The verdict says what moved. It *regressed* (exit code 1, for CI) when B's step time is
10% or more slower than A's (a phase that moved while the step time did not is time
shifted between phases: a change, not a regression), when B has an anomaly kind A has
not in the steps both runs reached, or when B is suspected of leaking memory where A is
not. The JSON form
(:meth:`Comparison.to_json`) is documented in docs/compare.md; bump ``SCHEMA`` when a
field changes meaning. Needs no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stabmon.errors import StabmonError
from stabmon.report.compare_rows import (
    amp_rows,
    anomalies_past,
    anomaly_rows,
    environment_rows,
    goodput_rows,
    memory_rows,
    throughput_rows,
)
from stabmon.report.digest import RankDigest, RunDigest, read_digest
from stabmon.report.events import find_run
from stabmon.report.steptime import Spread, StepTime, compare_step_time

__all__ = ["SCHEMA", "Comparison", "Verdict", "compare_runs", "read_for_compare"]

SCHEMA = "stabmon.compare/1"


@dataclass(frozen=True)
class Verdict:
    """``status``: regressed, changed (moved, none slower), inconclusive or unchanged."""

    status: str
    lines: tuple[str, ...]

    @property
    def regressed(self) -> bool:
        return self.status == "regressed"


@dataclass(frozen=True)
class Comparison:
    """Everything ``stabmon compare`` shows; each list holds plain JSON-ready rows."""

    a: RunDigest
    b: RunDigest
    rank: int | None
    environment: list[dict[str, Any]]
    step_time: StepTime
    throughput: list[dict[str, Any]]
    memory: list[dict[str, Any]]
    amp: list[dict[str, Any]]
    anomalies: list[dict[str, Any]]
    goodput: list[dict[str, Any]]
    verdict: Verdict
    #: What the comparison itself left out or could not match (ranks, steps).
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The comparison as docs/compare.md's schema describes it (strict JSON values)."""
        found: dict[str, Any] = _json_safe(
            {
                "schema": SCHEMA,
                "a": _run_json(self.a),
                "b": _run_json(self.b),
                "rank": self.rank,
                "verdict": {
                    "status": self.verdict.status,
                    "regressed": self.verdict.regressed,
                    "lines": list(self.verdict.lines),
                },
                "environment": self.environment,
                "step_time": self.step_time.to_json(),
                "throughput": self.throughput,
                "memory": self.memory,
                "amp": self.amp,
                "anomalies": self.anomalies,
                "goodput": self.goodput,
                "notes": {"a": self.a.notes, "b": self.b.notes, "compare": list(self.notes)},
            }
        )
        return found


def read_for_compare(path: Path, name: str) -> RunDigest:
    """Run ``name`` (A or B) at ``path``: a run's own directory, else a one-line error."""
    try:
        is_link = path.is_symlink()
        is_directory = path.is_dir()
    except OSError as error:
        raise StabmonError(f"run {name}: {path}: {error.strerror or error}") from None
    if is_link:
        raise StabmonError(
            f"run {name}: {path} is a symbolic link, which compare does not "
            "follow (the run directory may be shared); pass the directory itself"
        )
    if not is_directory:
        what = "is not a directory" if path.exists() else "does not exist"
        raise StabmonError(
            f"run {name}: {path} {what}; pass a run directory, <run_dir>/<run_id>, as printed "
            "by stabmon at attach"
        )
    try:
        directory, _, _ = find_run(path)
    except StabmonError as error:
        raise StabmonError(f"run {name}: {error}") from None
    if directory != path:
        raise StabmonError(
            f"run {name}: {path} holds runs, not one run's logs; pass one of them, "
            f"such as {directory}"
        )
    digest = read_digest(path)
    if not any(rank.log.records for rank in digest.ranks):
        raise StabmonError(
            f"run {name}: no record could be read from the event logs in {path} "
            f"({'; '.join(digest.notes) or 'they are empty'})"
        )
    return digest


def compare_runs(a: RunDigest, b: RunDigest, rank: int | None = None) -> Comparison:
    """Compare run ``b`` with run ``a`` (the reference), over every rank or only ``rank``."""
    a_ranks, b_ranks = _selected(a, rank, "A"), _selected(b, rank, "B")
    step_time = compare_step_time(a, b, a_ranks, b_ranks)
    anomalies = anomaly_rows(a_ranks, b_ranks, step_time.last_step)
    memory = memory_rows(a_ranks, b_ranks, step_time.first_step)
    environment = environment_rows(a, b, a_ranks, b_ranks)
    verdict = _verdict(step_time, anomalies, memory)
    notes = _notes(a, b, a_ranks, b_ranks, step_time.last_step)
    return Comparison(
        a,
        b,
        rank,
        environment,
        step_time,
        throughput_rows(a_ranks, b_ranks),
        memory,
        amp_rows(a_ranks, b_ranks),
        anomalies,
        goodput_rows(a_ranks, b_ranks),
        verdict,
        tuple(notes),
    )


def _notes(
    a: RunDigest, b: RunDigest, a_ranks: list[RankDigest], b_ranks: list[RankDigest], last: int
) -> list[str]:
    """What the comparison left out: ranks only one run has, anomalies past ``last``."""
    notes = []
    have_a, have_b = {r.rank for r in a_ranks}, {r.rank for r in b_ranks}
    if have_a != have_b and a.world_size() == b.world_size():
        common = ", ".join(map(str, sorted(have_a & have_b))) or "none"
        notes.append(
            f"the runs' ranks differ (A {_ranks(have_a)}, B {_ranks(have_b)}) though both have "
            f"world size {a.world_size()}: a rank's log is missing. Step time "
            f"is compared over the ranks both have ({common}); throughput, memory and goodput "
            "cover the ranks each run has"
        )
    past = {name: anomalies_past(ranks, last) for name, ranks in (("A", a_ranks), ("B", b_ranks))}
    if any(past.values()):
        left = ", ".join(f"{count} in {name}" for name, count in past.items() if count)
        notes.append(
            f"anomalies are counted up to step {last}, the last step both runs reached; "
            f"{left} after it left out"
        )
    return notes


def _ranks(ranks: set[int]) -> str:
    return ", ".join(map(str, sorted(ranks))) or "none"


def _selected(run: RunDigest, rank: int | None, name: str) -> list[RankDigest]:
    if rank is None:
        return run.ranks
    chosen = [r for r in run.ranks if r.rank == rank]
    if not chosen:
        have = ", ".join(str(r.rank) for r in run.ranks) or "none"
        raise StabmonError(
            f"--rank {rank}: run {name} ({run.run_id}) has no rank {rank} (its "
            f"ranks: {have}); pass one both runs have"
        )
    return chosen


def _verdict(
    step_time: StepTime, anomalies: list[dict[str, Any]], memory: list[dict[str, Any]]
) -> Verdict:
    regressions, changes = _timing_lines(step_time)
    for row in anomalies:
        count_a, count_b = row["a"]["count"], row["b"]["count"]
        if count_b and not count_a:
            regressions.append(
                f"new in B: {row['kind']} x{count_b} (step(s) {_steps(row['b']['steps'], count_b)})"
            )
        elif count_a and not count_b:
            changes.append(f"gone in B: {row['kind']} (A had {count_a})")
    for row in memory:
        if (row["b"] or {}).get("leak") and not (row["a"] or {}).get("leak"):
            regressions.append(
                f"memory leak suspected in B on {row['device']} (rank {row['rank']}), not in A"
            )
    lines = regressions + changes
    if not step_time.comparable:
        lines.append(f"step time inconclusive: {'; '.join(step_time.reasons)}")
    if regressions:
        return Verdict("regressed", tuple(lines))
    if changes:
        return Verdict("changed", tuple(lines))
    if not step_time.comparable:
        return Verdict("inconclusive", tuple(lines))
    return Verdict("unchanged", ("no median moved by 10% or more; no new anomaly kind",))


def _timing_lines(step_time: StepTime) -> tuple[list[str], list[str]]:
    """(regressions: step times that got slower, changes: step times that got faster and
    the whole run's phases that moved), whole run first. Only a step time regresses: a
    phase that moved while the step did not is time shifted between phases."""
    regressions: list[str] = []
    changes: list[str] = []
    if not step_time.comparable:
        return regressions, changes
    span = f"steps {step_time.first_step}-{step_time.last_step}"
    step_moved = any(r.moved for r in step_time.whole() if r.phase == "step")
    for row in step_time.rows:
        if row.moved is None or (row.rank is not None and row.phase != "step"):
            continue
        where = "" if row.rank is None else f" on rank {row.rank}"
        line = f"{row.phase} {_percent(row.change)}{where}: {_ms(row.a)} -> {_ms(row.b)} per step"
        if row.phase != "step":
            shifted = "" if step_moved else " (time shifted between phases: the step did not move)"
            changes.append(line + shifted)
            continue
        line += f" ({span})" if row.rank is None else ""
        most = step_time.moved_most(row.rank)
        if most is not None:
            line += f"; the phase that moved most: {most.phase} ({_ms_delta(most.delta)})"
        (regressions if row.moved == "slower" else changes).append(line)
    return regressions, changes


def _percent(change: float | None) -> str:
    return "(new)" if change is None else f"{change:+.0%}"


def _ms(spread: Spread | None) -> str:
    return "-" if spread is None else f"{spread.median * 1e3:.3g} ms"


def _ms_delta(delta: float | None) -> str:
    return "-" if delta is None else f"{delta * 1e3:+.3g} ms per step"


def _steps(steps: list[int], count: int) -> str:
    return ", ".join(map(str, steps)) + (" ..." if count > len(steps) else "")


def _run_json(run: RunDigest) -> dict[str, Any]:
    return {
        "run": run.run_id,
        "directory": str(run.run.directory),
        "ranks": [rank.rank for rank in run.ranks],
        "steps": run.steps,
        "states": {str(rank.rank): rank.log.state for rank in run.ranks},
        "world_size": run.world_size(),
    }


def _json_safe(value: Any) -> Any:
    """Fractions to 6 significant digits (as the event log keeps them); JSON has no NaN or
    Infinity, so a non-finite figure is written as null."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return value if value.is_integer() else float(f"{value:.6g}")
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value
