"""``stabmon compare``'s plain-text answer: the verdict first, then one table per section."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stabmon.report.compare import Comparison
from stabmon.report.digest import RunDigest
from stabmon.report.steptime import Spread

__all__ = ["Table", "format_comparison", "tables"]

_NONE = "-"


@dataclass(frozen=True)
class Table:
    """One section of the answer: the same cells on the terminal and in the HTML page."""

    id: str
    title: str
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]
    #: Said instead of the table when it has no rows.
    empty: str
    #: Said before the table (the reason a comparison is inconclusive).
    lead: str = ""


def format_comparison(comparison: Comparison) -> str:
    """Everything the comparison holds, for a terminal: the verdict first, then each table."""
    c = comparison
    scope = "every rank" if c.rank is None else f"rank {c.rank}"
    lines = [f"stabmon compare (B against A, {scope})", *run_lines(c), "",
             f"Verdict: {c.verdict.status.upper()}"]  # fmt: skip
    lines += [f"  - {line}" for line in c.verdict.lines]
    for table in tables(c):
        lines += ["", table.title]
        lines += [f"  {table.lead}"] if table.lead else []
        lines += _aligned(table.header, table.rows) or [f"  {table.empty}"]
    notes = all_notes(c)
    if notes:
        lines += ["", "Notes", *(f"  - {note}" for note in notes)]
    return "\n".join(lines)


def run_lines(comparison: Comparison) -> list[str]:
    """One line per run: id, directory, ranks, steps and how it ended."""
    return [_run_line("A", comparison.a), _run_line("B", comparison.b)]


def all_notes(comparison: Comparison) -> list[str]:
    """What the readers noted (lines skipped, too few blocks), each with its run."""
    c = comparison
    notes = [f"A: {note}" for note in c.a.notes] + [f"B: {note}" for note in c.b.notes]
    return notes + list(c.step_time.notes) + list(c.notes)


def tables(comparison: Comparison) -> list[Table]:
    """The answer's sections after the verdict, in order."""
    c = comparison
    step_time = c.step_time
    return [
        Table("environment", "Environment (only what differs)", ("", "A", "B"),
              [(d["key"], _text(d["a"]), _text(d["b"])) for d in c.environment],
              "no difference"),
        Table("step-time",
              f"Step time per phase (ms per step: median [p25-p75] of n throughput blocks; "
              f"steps {step_time.first_step}-{step_time.last_step}, after "
              f"{step_time.warmup_steps} warm-up steps)",
              ("rank", "phase", "A", "B", "change", ""), _step_rows(c),
              "no throughput block in either run",
              "" if step_time.comparable else "INCONCLUSIVE: " + "; ".join(step_time.reasons)),
        Table("throughput", "Throughput (over wall time)",
              ("rank", "", "steps/s", "samples/s", "tokens/s", "samples/step", "FLOPs/step",
               "MFU", "goodput"), _throughput_rows(c), "no throughput record"),
        Table("memory", "Memory (peak; slope after warm-up; leak suspected)",
              ("rank", "device", "peak A", "peak B", "slope A", "slope B", "leak A", "leak B"),
              _memory_rows(c), "no memory sample"),
        Table("amp", "AMP (GradScaler)",
              ("rank", "", "last scale", "lowest scale", "skipped steps"), _amp_rows(c),
              "no GradScaler in either run"),
        Table("anomalies", "Anomalies by kind", ("kind", "A", "B"),
              [(row["kind"], _anomaly_side(row["a"]), _anomaly_side(row["b"]))
               for row in c.anomalies], "none in either run"),
        Table("goodput", "Goodput (share of wall time, every rank compared)", ("time in", "A", "B"),
              [(row["cause"], _share(row["a"]), _share(row["b"])) for row in c.goodput],
              "no throughput record"),
    ]  # fmt: skip


def _run_line(name: str, run: RunDigest) -> str:
    states = sorted({rank.log.state for rank in run.ranks})
    count = len(run.ranks)
    ranks = f"{count} rank{'s' if count != 1 else ''}"
    return f"  {name}: {run.run_id} ({run.run.directory}): {ranks}, {run.steps:,} steps, " + (
        ", ".join(states)
    )


def _step_rows(c: Comparison) -> list[tuple[str, ...]]:
    return [
        (_scope(c, row.rank), row.phase, _spread(row.a), _spread(row.b),
         _change(row.change, row.delta), row.moved or "")
        for row in c.step_time.rows
    ]  # fmt: skip


def _throughput_rows(c: Comparison) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for row in c.throughput:
        for name in ("a", "b"):
            side = row[name] or {}
            rows.append(
                (
                    _scope(c, row["rank"]),
                    name.upper(),
                    _num(side.get("steps_per_second")),
                    _num(side.get("samples_per_second")),
                    _num(side.get("tokens_per_second")),
                    _num(side.get("samples_per_step")),
                    _num(side.get("flops_per_step")),
                    _share(side.get("mfu")),
                    _share(side.get("goodput")),
                )
            )
    return rows


def _memory_rows(c: Comparison) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for row in c.memory:
        a, b = row["a"] or {}, row["b"] or {}
        rows.append(
            (
                str(row["rank"]),
                row["device"],
                _mib(a.get("peak_bytes")),
                _mib(b.get("peak_bytes")),
                _slope(a.get("slope_bytes_per_step")),
                _slope(b.get("slope_bytes_per_step")),
                _yes(a.get("leak")),
                _yes(b.get("leak")),
            )
        )
    return rows


def _amp_rows(c: Comparison) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for row in c.amp:
        for name in ("a", "b"):
            side = row[name] or {}
            rows.append(
                (
                    str(row["rank"]),
                    name.upper(),
                    _num(side.get("last_scale")),
                    _num(side.get("min_scale")),
                    str(side.get("skipped_steps", _NONE)),
                )
            )
    return rows


def _scope(c: Comparison, rank: int | None) -> str:
    """A row's rank: ``all`` for every rank compared (the one rank under ``--rank``)."""
    if rank is not None:
        return str(rank)
    return "all" if c.rank is None else str(c.rank)


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to their widest cell, two spaces apart; [] without rows."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    return [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in (header, *rows)
    ]


def _spread(spread: Spread | None) -> str:
    if spread is None:
        return _NONE
    return (
        f"{spread.median * 1e3:.3g} [{spread.p25 * 1e3:.3g}-{spread.p75 * 1e3:.3g}] "
        f"n={spread.blocks}"
    )


def _change(change: float | None, delta: float | None) -> str:
    if delta is None:
        return _NONE
    relative = "" if change is None else f"{change:+.0%} "
    return f"{relative}({delta * 1e3:+.3g} ms)"


def _anomaly_side(side: dict[str, Any]) -> str:
    if not side["count"]:
        return "0"
    steps = ", ".join(map(str, side["steps"])) + (
        " ..." if side["count"] > len(side["steps"]) else ""
    )
    ranks = ", ".join(map(str, side["ranks"]))
    return f"{side['count']} (step {steps}; rank {ranks})"


def _text(value: object) -> str:
    return "(absent)" if value is None else str(value)


def _num(value: object) -> str:
    if not isinstance(value, (int, float)):
        return _NONE
    return f"{value:,.0f}" if 1e3 <= abs(value) < 1e9 else f"{value:.4g}"


def _share(value: object) -> str:
    return _NONE if not isinstance(value, (int, float)) else f"{value:.1%}"


def _mib(value: object) -> str:
    return _NONE if not isinstance(value, (int, float)) else f"{value / 2**20:,.1f} MiB"


def _slope(value: object) -> str:
    return _NONE if not isinstance(value, (int, float)) else f"{value:+,.0f} B/step"


def _yes(value: object) -> str:
    return _NONE if value is None else ("yes" if value else "no")
