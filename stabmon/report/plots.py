"""The report's plots: matplotlib figures rendered to inline SVG (no file, no network).

matplotlib is the optional ``report`` extra, imported only here and only when
a report is made; without it :func:`require_matplotlib` says how to install it.
Figures are built with ``matplotlib.figure.Figure`` directly, never pyplot, so
no global figure state or GUI backend is involved. Long runs are thinned to
at most ``MAX_POINTS`` points per line: a plot 1,000 pixels wide shows no more.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from stabmon.errors import StabmonError
from stabmon.report.events import RankLog, Run, number

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "KIND_COLORS",
    "Plots",
    "draw_line",
    "finish_axes",
    "new_figure",
    "rank_color",
    "require_matplotlib",
    "to_svg",
]

MAX_POINTS = 2000
#: As the README installs stabmon (from a clone; it is not on PyPI): the ``report`` extra is
#: matplotlib alone.
INSTALL_HINT = "pip install matplotlib (the report extra: pip install './stabmon[report]')"

#: One colour per anomaly kind, the same on every plot and in the table.
KIND_COLORS: dict[str, str] = {
    "nonfinite_grad": "#d62728",
    "nonfinite_loss": "#8c1c13",
    "grad_spike": "#ff7f0e",
    "loss_spike": "#9467bd",
    "memory_leak": "#8c564b",
    "stall": "#1f77b4",
    "device_mismatch": "#7f7f7f",
}
_RANK_COLORS = ("#2b6cb0", "#2f855a", "#b7791f", "#805ad5", "#c53030", "#319795", "#d53f8c")


def require_matplotlib() -> None:
    """Raise a one-line StabmonError naming the extra when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise StabmonError(
            f"stabmon report needs matplotlib, which is not installed: {INSTALL_HINT}"
        ) from error


class Plots:
    """Renders each plot of one run as an SVG string (None when the run has no data for it)."""

    def __init__(self, run: Run, *, module_rank: int | None = None) -> None:
        require_matplotlib()
        self._run = run
        ranks = [log.rank for log in run.ranks]
        self._module_rank = module_rank if module_rank in ranks else min(ranks, default=0)
        self._anomalies = run.anomalies()

    def loss(self) -> str | None:
        series = {log.rank: _points(_samples(log), "loss") for log in self._run.ranks}
        if not any(series.values()):
            return None
        figure, axes = new_figure()
        for rank, points in series.items():
            draw_line(axes, points, rank_color(rank), f"rank {rank}")
        values = [value for points in series.values() for _, value in points]
        wide = min(values) > 0 and max(values) > 100 * min(values)
        if wide:  # a spike would flatten the rest of the curve to a line at zero
            axes.set_yscale("log")
        self._mark(axes, ("loss_spike", "nonfinite_loss", "stall", "nonfinite_grad"), "loss")
        finish_axes(axes, "loss (log scale)" if wide else "loss", "training loss, sampled")
        return to_svg(figure)

    def grad_norm(self) -> str | None:
        series = {log.rank: _points(_samples(log), "grad_norm") for log in self._run.ranks}
        if not any(series.values()):
            return None
        figure, axes = new_figure(height=4.2)
        module_log = next(log for log in self._run.ranks if log.rank == self._module_rank)
        modules = _module_series(_samples(module_log))
        for index, (module, points) in enumerate(sorted(modules.items())[:12]):
            draw_line(
                axes, points, f"C{index % 10}", f"{module} (rank {module_log.rank})", 0.9, 0.55
            )
        for rank, points in series.items():
            draw_line(axes, points, "black" if rank == self._module_rank else rank_color(rank),
                  f"global, rank {rank}", 2.0)  # fmt: skip
        if _positive(series) or _positive(modules):
            axes.set_yscale("log")
        self._mark(axes, ("grad_spike", "nonfinite_grad", "stall"), "grad_norm")
        finish_axes(axes, "L2 norm (log scale)", "gradient norm: global and per module")
        return to_svg(figure)

    def step_time(self) -> str | None:
        steps = {log.rank: _points(_samples(log), "step_seconds", 1e3) for log in self._run.ranks}
        waits = {
            log.rank: _points(_samples(log), "data_wait_seconds", 1e3) for log in self._run.ranks
        }
        if not any(steps.values()) and not any(waits.values()):
            return None
        figure, axes = new_figure()
        for rank in steps:
            draw_line(axes, steps[rank], rank_color(rank), f"step time, rank {rank}")
            draw_line(
                axes, waits[rank], rank_color(rank), f"input wait, rank {rank}", 1.2, 0.8, "--"
            )
        self._mark(axes, ("stall",), None)
        finish_axes(axes, "milliseconds (mean per sample)", "step time and input wait")
        return to_svg(figure)

    def memory(self) -> str | None:
        figure, axes = new_figure(height=4.0)
        drawn = False
        for log in self._run.ranks:
            for index, (device, points) in enumerate(sorted(_memory_series(log).items())):
                color = f"C{(log.rank * 3 + index) % 10}"
                draw_line(axes, points, color, f"{device}, rank {log.rank}", 1.8, marker="o")
                windows = _leak_windows(points, log.config)
                for number_, (start, end, limit) in enumerate(windows):
                    # "_"-prefixed labels stay out of the legend: one entry per device.
                    label = f"leak threshold, {device}, rank {log.rank}" if not number_ else "_"
                    axes.hlines(limit, start, end, colors=color, linestyles=":", linewidth=1.4,
                                label=label)  # fmt: skip
                drawn = drawn or bool(points)
        if not drawn:
            return None
        for record in self._anomalies:
            if record.get("kind") == "memory_leak" and isinstance(record.get("epoch"), int):
                value = number(record.get("bytes"))
                if value is not None:
                    axes.plot([record["epoch"]], [value / 2**20], marker="X", markersize=11,
                              color=KIND_COLORS["memory_leak"], linestyle="none",
                              label="memory_leak")  # fmt: skip
        finish_axes(axes, "MiB at epoch end", "memory per epoch, per device", xlabel="epoch")
        return to_svg(figure)

    def gpu_utilization(self) -> str | None:
        series: dict[str, list[tuple[float, float]]] = {}
        for log in self._run.ranks:
            for sample in _samples(log):
                utilization = sample.get("gpu_utilization")
                if not isinstance(utilization, Mapping):
                    continue
                for device, ratio in utilization.items():
                    value = number(ratio)
                    if value is not None and isinstance(sample.get("step"), int):
                        series.setdefault(f"{device}, rank {log.rank}", []).append(
                            (sample["step"], value * 100)
                        )
        if not series:
            return None
        figure, axes = new_figure()
        for index, (name, points) in enumerate(sorted(series.items())):
            draw_line(axes, _thin(points), f"C{index % 10}", name)
        axes.set_ylim(0, 105)
        finish_axes(axes, "% of time busy", "GPU utilization")
        return to_svg(figure)

    def _mark(self, axes: Axes, kinds: Sequence[str], field: str | None) -> None:
        """Anomalies as vertical lines at their step, a cross at their value when finite, and a
        triangle at the top when their value is NaN or Inf."""
        from matplotlib.transforms import blended_transform_factory

        seen: set[str] = set()
        for record in self._anomalies:
            kind = str(record.get("kind"))
            step = record.get("step")
            if kind not in kinds or not isinstance(step, int):
                continue
            color = KIND_COLORS.get(kind, "#444444")
            axes.axvline(step, color=color, linestyle="--", linewidth=1.1, alpha=0.85,
                         label=None if kind in seen else kind)  # fmt: skip
            seen.add(kind)
            value = number(record.get(field)) if field else None
            if value is not None and math.isfinite(value) and value > 0:
                axes.plot([step], [value], marker="X", markersize=10, color=color, linestyle="none")
            elif value is not None and not math.isfinite(value):
                # A NaN or Inf has no place on the value axis: drawn at the top, at its step.
                top = blended_transform_factory(axes.transData, axes.transAxes)
                label = None if "not finite" in seen else f"{field} not finite (NaN/Inf)"
                axes.plot([step], [0.97], marker="v", markersize=11, color=color,
                          linestyle="none", transform=top, label=label)  # fmt: skip
                seen.add("not finite")


def _samples(log: RankLog) -> list[dict[str, Any]]:
    """The log's step samples; logs written before step samples existed fall back to epochs."""
    samples = log.of("step_sample")
    return samples if samples else log.of("epoch")


def _points(
    records: Iterable[Mapping[str, Any]], field: str, scale: float = 1.0
) -> list[tuple[float, float]]:
    points = []
    for record in records:
        step, value = record.get("step"), number(record.get(field))
        if isinstance(step, int) and value is not None and math.isfinite(value):
            points.append((float(step), value * scale))
    return _thin(points)


def _module_series(samples: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    series: dict[str, list[tuple[float, float]]] = {}
    for sample in samples:
        norms, step = sample.get("module_grad_norms"), sample.get("step")
        if not isinstance(norms, Mapping) or not isinstance(step, int):
            continue
        for module, raw in norms.items():
            value = number(raw)
            if value is not None and math.isfinite(value) and value > 0:
                series.setdefault(str(module), []).append((float(step), value))
    return {module: _thin(points) for module, points in series.items()}


def _memory_series(log: RankLog) -> dict[str, list[tuple[float, float]]]:
    series: dict[str, list[tuple[float, float]]] = {}
    for record in log.of("epoch"):
        memory, epoch = record.get("memory"), record.get("epoch")
        if not isinstance(memory, Mapping) or not isinstance(epoch, int):
            continue
        for device, raw in memory.items():
            value = number(raw)
            if value is not None and math.isfinite(value):
                series.setdefault(str(device), []).append((float(epoch), value / 2**20))
    return series


def _leak_windows(
    points: list[tuple[float, float]], config: Mapping[str, Any]
) -> list[tuple[float, float, float]]:
    """The leak rule's windows as (start epoch, end epoch, threshold MiB), as the detector has.

    A window starts at the baseline epoch (the first after ``leak_warmup_epochs``)
    and closes at the first sample ``leak_window_epochs`` later; it counts as
    growing when its closing sample is above its start times (1 + ``leak_threshold``).
    """
    threshold = number(config.get("leak_threshold")) or 0.03
    length = config.get("leak_window_epochs", 10)
    warmup = config.get("leak_warmup_epochs", 1)
    if not isinstance(length, int) or not isinstance(warmup, int) or length < 1:
        return []
    usable = [(epoch, value) for epoch, value in points if epoch >= warmup]
    if not usable:
        return []
    windows = []
    start, start_value = usable[0]
    for epoch, value in usable[1:]:
        if epoch >= start + length:
            windows.append((start, epoch, start_value * (1 + threshold)))
            start, start_value = epoch, value
    last = usable[-1][0]
    if start < last < start + length:  # the open window: drawn as far as the run got
        windows.append((start, last, start_value * (1 + threshold)))
    return windows


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    stride = math.ceil(len(points) / MAX_POINTS)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def _positive(series: Mapping[Any, list[tuple[float, float]]]) -> bool:
    return any(value > 0 for points in series.values() for _, value in points)


def rank_color(rank: int) -> str:
    """The colour of ``rank``'s lines, the same on every page."""
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


def new_figure(height: float = 3.4) -> tuple[Figure, Axes]:
    """A page-wide figure with one gridded axes (no pyplot: no global figure state)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, height), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    axes.grid(True, color="#dddddd", linewidth=0.6)
    return figure, axes


def draw_line(
    axes: Axes,
    points: list[tuple[float, float]],
    color: str,
    label: str,
    width: float = 1.6,
    alpha: float = 1.0,
    style: str = "-",
    marker: str | None = None,
) -> None:
    """``points`` as one line of ``axes``; nothing when there are none."""
    if not points:
        return
    xs, ys = zip(*points, strict=True)
    axes.plot(xs, ys, color=color, label=label, linewidth=width, alpha=alpha, linestyle=style,
              marker=marker, markersize=3.5)  # fmt: skip


def finish_axes(axes: Axes, ylabel: str, title: str, *, xlabel: str = "step") -> None:
    """Labels, the title, and the legend outside the plot on the right."""
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title, loc="left", fontsize=10, color="#4a5568")
    handles, labels = axes.get_legend_handles_labels()
    if handles:
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def to_svg(figure: Figure) -> str:
    """``figure`` as inline SVG that scales with the page."""
    import matplotlib

    buffer = io.StringIO()
    # Text stays text (smaller, selectable); the page's font renders it.
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        figure.savefig(buffer, format="svg")
    text = buffer.getvalue()
    start = text.find("<svg")
    return re.sub(r'(<svg[^>]*?) width="[^"]*" height="[^"]*"', r"\1", text[start:], count=1)
