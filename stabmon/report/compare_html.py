"""``stabmon compare -o page.html``: the comparison as one self-contained page.

The page is ``stabmon report``'s: its style sheet, inline SVG plots drawn with
matplotlib (the ``report`` extra), no script and no network request. Both runs are on
the same plots, A drawn solid and B dashed, one colour per rank, aligned by step. The
tables hold the very cells the terminal shows (:func:`stabmon.report.compare_text.tables`),
escaped: run ids, directories and variable values are user data.
"""

from __future__ import annotations

import time
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from stabmon.report.compare import Comparison
from stabmon.report.compare_text import Table, all_notes, run_lines, tables
from stabmon.report.digest import RankDigest, RunDigest

# The report's style and figure helpers, so both pages look alike.
from stabmon.report.html import STYLE, write_page_atomically
from stabmon.report.plots import (
    KIND_COLORS,
    draw_line,
    finish_axes,
    new_figure,
    rank_color,
    require_matplotlib,
    to_svg,
)
from stabmon.report.verdict import when

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["SECTION_IDS", "render_page", "write_page"]

SECTION_IDS = (
    "verdict",
    "environment",
    "step-time",
    "throughput",
    "memory",
    "amp",
    "anomalies",
    "goodput",
    "notes",
)
_STYLES = {"a": "-", "b": "--"}


def write_page(comparison: Comparison, output: Path) -> None:
    """Write the page to ``output`` atomically (a browser reloading it never sees half)."""
    require_matplotlib()
    write_page_atomically(output, render_page(comparison))


def render_page(comparison: Comparison, *, now: float | None = None) -> str:
    """The comparison as one HTML document."""
    c = comparison
    plots = {
        "step-time": [_step_time_plot(c), _wall_time_plot(c), _phase_plot(c)],
        "memory": [_memory_plot(c)],
        "amp": [_scale_plot(c)],
    }
    sections = [_verdict_section(c)]
    for table in tables(c):
        svgs = "".join(svg for svg in plots.get(table.id, []) if svg is not None)
        sections.append(_table_section(table, svgs))
    notes = "".join(f"<li>{escape(note)}</li>" for note in all_notes(c))
    sections.append(
        f'<section id="notes"><h2>Notes</h2>{f"<ul>{notes}</ul>" if notes else ""}'
        '<p class="sub">A is drawn solid, B dashed; one colour per rank.</p></section>'
    )
    title = f"stabmon compare: {c.a.run_id} (A) and {c.b.run_id} (B)"
    generated = when(time.time() if now is None else now)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body><main>"
        f'<h1>{escape(title)}</h1><div class="sub">generated {escape(generated)}</div>'
        + "".join(sections)
        + "</main></body></html>\n"
    )


def _verdict_section(c: Comparison) -> str:
    css = "bad" if c.verdict.regressed else "ok"
    lines = "".join(f"<li>{escape(line)}</li>" for line in c.verdict.lines)
    runs = "".join(f"<li>{escape(line.strip())}</li>" for line in run_lines(c))
    return (
        f'<section id="verdict"><h2>Verdict</h2><div class="verdict {css}">'
        f"{escape(c.verdict.status.upper())}</div><ul>{lines}</ul><ul>{runs}</ul></section>"
    )


def _table_section(table: Table, svgs: str) -> str:
    lead = f'<p class="verdict">{escape(table.lead)}</p>' if table.lead else ""
    if table.rows:
        head = "".join(f"<th>{escape(cell)}</th>" for cell in table.header)
        rows = "".join(
            "<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>"
            for row in table.rows
        )
        body = f"<table><tr>{head}</tr>{rows}</table>"
    else:
        body = f'<p class="empty">{escape(table.empty)}</p>'
    return f'<section id="{table.id}"><h2>{escape(table.title)}</h2>{lead}{svgs}{body}</section>'


def _sides(c: Comparison) -> list[tuple[str, RunDigest, list[RankDigest]]]:
    """(a or b, run, the ranks compared) for both runs."""
    chosen = [(c.a, "a"), (c.b, "b")]
    return [(name, run, [r for r in run.ranks if c.rank in (None, r.rank)]) for run, name in chosen]


def _step_time_plot(c: Comparison) -> str | None:
    """Each block's step time at its last step, both runs, with the compared steps shaded."""
    figure, axes = new_figure()
    drawn = False
    for name, _, ranks in _sides(c):
        for rank in ranks:
            points = [(float(b.last_step), b.step_seconds * 1e3) for b in rank.blocks()]
            draw_line(axes, points, rank_color(rank.rank), f"{name.upper()}, rank {rank.rank}",
                  style=_STYLES[name])  # fmt: skip
            drawn = drawn or bool(points)
    if not drawn:
        return None
    axes.axvspan(c.step_time.first_step, c.step_time.last_step, color="#edf2f7", zorder=0,
                 label="steps compared")  # fmt: skip
    _mark_anomalies(c, axes)
    finish_axes(axes, "ms per step (block mean)", "step time: A solid, B dashed")
    return to_svg(figure)


def _wall_time_plot(c: Comparison) -> str | None:
    """The compared blocks' step times by wall time since each rank's warm-up ended (the
    start of its first compared block): runs of different speeds, side by side in time."""
    figure, axes = new_figure()
    drawn = False
    first, last = c.step_time.first_step, c.step_time.last_step
    for name, _, ranks in _sides(c):
        for rank in ranks:
            compared = [b for b in rank.blocks() if first <= b.first_step
                        and b.last_step <= last and b.end_time is not None]  # fmt: skip
            start = next((b.start_time for b in compared if b.start_time is not None), None)
            if start is None:
                continue
            points = [((b.end_time or start) - start, b.step_seconds * 1e3) for b in compared]
            draw_line(axes, points, rank_color(rank.rank), f"{name.upper()}, rank {rank.rank}",
                      style=_STYLES[name])  # fmt: skip
            drawn = drawn or bool(points)
    if not drawn:
        return None
    finish_axes(
        axes,
        "ms per step (block mean)",
        "step time by wall time after warm-up: A solid, B dashed",
        xlabel="seconds since the warm-up ended",
    )
    return to_svg(figure)


def _phase_plot(c: Comparison) -> str | None:
    """The whole run's median seconds per step by phase, A beside B."""
    rows = [row for row in c.step_time.whole() if row.a is not None or row.b is not None]
    if not rows:
        return None
    figure, axes = new_figure(height=0.5 * len(rows) + 1.2)
    positions = range(len(rows))
    for offset, name in ((-0.2, "a"), (0.2, "b")):
        medians = [(getattr(row, name).median * 1e3 if getattr(row, name) else 0.0) for row in rows]
        axes.barh([p + offset for p in positions], medians, height=0.38, label=name.upper(),
                  color="#2b6cb0" if name == "a" else "#c05621")  # fmt: skip
    axes.set_yticks(list(positions), [row.phase for row in rows])
    axes.invert_yaxis()
    finish_axes(axes, "", "median ms per step, by phase", xlabel="ms per step")
    return to_svg(figure)


def _memory_plot(c: Comparison) -> str | None:
    figure, axes = new_figure()
    drawn = False
    for name, _, ranks in _sides(c):
        for rank in ranks:
            for index, (device, points) in enumerate(sorted(rank.memory().items())):
                color = f"C{(rank.rank * 3 + index) % 10}"
                scaled = [(float(step), value / 2**20) for step, value in points]
                draw_line(axes, scaled, color, f"{name.upper()}, {device}, rank {rank.rank}",
                      style=_STYLES[name], marker="o")  # fmt: skip
                drawn = drawn or bool(points)
    if not drawn:
        return None
    finish_axes(axes, "MiB", "memory: A solid, B dashed")
    return to_svg(figure)


def _scale_plot(c: Comparison) -> str | None:
    figure, axes = new_figure()
    drawn = False
    for name, _, ranks in _sides(c):
        for rank in ranks:
            points = [(float(s.step), s.loss_scale) for s in rank.samples if s.loss_scale]
            draw_line(axes, [(x, y) for x, y in points if y is not None], rank_color(rank.rank),
                  f"{name.upper()}, rank {rank.rank}", style=_STYLES[name])  # fmt: skip
            drawn = drawn or bool(points)
    if not drawn:
        return None
    axes.set_yscale("log")
    finish_axes(axes, "loss scale (log)", "GradScaler loss scale: A solid, B dashed")
    return to_svg(figure)


def _mark_anomalies(c: Comparison, axes: Axes) -> None:
    """A vertical line at each anomaly's step (the first few per kind and run)."""
    for row in c.anomalies:
        color = KIND_COLORS.get(row["kind"], "#444444")
        for name in ("a", "b"):
            for index, step in enumerate(row[name]["steps"]):
                label = f"{row['kind']} ({name.upper()})" if index == 0 else None
                axes.axvline(step, color=color, linestyle=_STYLES[name], linewidth=1.1,
                             label=label)  # fmt: skip
