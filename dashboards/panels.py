"""Panel builders for stabmon's Grafana dashboards: PromQL from ``stabmon.contract``, never typed.

A dashboard file reads as a list of panels::

    from panels import RUN_RANK, Query, layout, rate, sum_by, timeseries
    from stabmon import contract

    step_rate = timeseries(
        "Step rate",
        [Query(sum_by(("run", "rank"), rate(contract.STEPS, *RUN_RANK)), "{{run}}/{{rank}}")],
        unit="suffix: steps/s",
        description="Optimizer steps per second, per rank.",
    )
    panels = layout(("Throughput", [step_rate]))

Every metric name comes from a ``MetricDef``; label values (phases, kinds) are
plain strings. Every panel and target queries the data source the dashboard's
``datasource`` variable points at, so the JSON imports into any Grafana whatever
its Prometheus is called (provisioning gives it the fixed uid ``stabmon-prometheus``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import attr
import yaml
from grafanalib.core import (
    REFRESH_ON_TIME_RANGE_CHANGE,
    SORT_ALPHA_ASC,
    SORT_NUMERIC_ASC,
    GridPos,
    RowPanel,
    Stat,
    Target,
    Template,
    TimeSeries,
)

from stabmon.contract import BUILD_INFO, GPU_UTILIZATION, MetricDef

#: The data source of every panel, target and annotation: whatever ``$datasource`` selects.
DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}

#: Grafana picks a step to suit the scrape interval; a fixed window would be empty or coarse.
RATE_WINDOW = "$__rate_interval"

#: Histogram series suffixes a query may add to a histogram's name.
HISTOGRAM_SUFFIXES: tuple[str, ...] = ("_bucket", "_sum", "_count")

GRID_WIDTH = 24

Panel = Any  # grafanalib's panels are untyped attrs classes


# --- PromQL -----------------------------------------------------------------------------------


def matches(label: str, pattern: str) -> str:
    """A regex label matcher, ``label=~"pattern"``."""
    return f'{label}=~"{pattern}"'


def equals(label: str, value: str) -> str:
    """An equality label matcher, ``label="value"``."""
    return f'{label}="{value}"'


#: The training dashboard's filter: the runs and ranks picked in its variables.
RUN_RANK: tuple[str, ...] = (matches("run", "$run"), matches("rank", "$rank"))
#: The GPU dashboard's filter: the GPUs picked in its variable.
GPUS: tuple[str, ...] = (matches("gpu", "$gpu"),)


def selector(metric: MetricDef, *matchers: str, suffix: str = "") -> str:
    """``name{matchers}``; ``suffix`` picks a histogram's ``_bucket``, ``_sum`` or ``_count``."""
    if suffix and (metric.type != "histogram" or suffix not in HISTOGRAM_SUFFIXES):
        raise ValueError(
            f"suffix {suffix!r} on {metric.type} {metric.name}: only histograms take one of "
            f"{', '.join(HISTOGRAM_SUFFIXES)}"
        )
    inner = ", ".join(matchers)
    return f"{metric.name}{suffix}{{{inner}}}" if inner else f"{metric.name}{suffix}"


#: The alert and recording rules: a dashboard may read what they record (issue 39).
RULES_FILE = (
    Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "rules" / "stabmon.rules.yml"
)


def recorded_series() -> frozenset[str]:
    """Every series the shipped rules record (``level:metric:operations``)."""
    groups = yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))["groups"]
    return frozenset(
        rule["record"] for group in groups for rule in group["rules"] if "record" in rule
    )


def recorded(name: str, *matchers: str) -> str:
    """``name{matchers}`` of a series the rules record: what a fleet view reads instead of
    every rank's raw series, computed once a minute rather than at every dashboard refresh."""
    if name not in recorded_series():
        raise ValueError(f"{name} is recorded by no rule in {RULES_FILE.name}")
    inner = ", ".join(matchers)
    return f"{name}{{{inner}}}" if inner else name


def _counter_range(
    function: str, metric: MetricDef, matchers: Sequence[str], suffix: str, window: str
) -> str:
    if metric.type == "gauge":
        raise ValueError(f"{function}() of gauge {metric.name}: use it only on counters")
    if metric.type == "histogram" and not suffix:
        raise ValueError(f"{function}() of histogram {metric.name}: pick a suffix, e.g. '_count'")
    return f"{function}({selector(metric, *matchers, suffix=suffix)}[{window}])"


def rate(metric: MetricDef, *matchers: str, suffix: str = "", window: str = RATE_WINDOW) -> str:
    """``rate(name{matchers}[window])`` of a counter (or a histogram series)."""
    return _counter_range("rate", metric, matchers, suffix, window)


def increase(metric: MetricDef, *matchers: str, suffix: str = "", window: str = RATE_WINDOW) -> str:
    """``increase(name{matchers}[window])``: events per window, counter resets handled."""
    return _counter_range("increase", metric, matchers, suffix, window)


def sum_by(labels: Iterable[str], expr: str, *, aggregation: str = "sum") -> str:
    """``sum by (labels) (expr)``; ``aggregation`` swaps in ``max``, ``avg``, ``count``..."""
    return f"{aggregation} by ({', '.join(labels)}) ({expr})"


def quantile(
    q: float, metric: MetricDef, *matchers: str, by: Iterable[str] = ("run", "rank")
) -> str:
    """``histogram_quantile(q, ...)`` of a histogram, per group of ``by``."""
    buckets = sum_by(("le", *by), rate(metric, *matchers, suffix="_bucket"))
    return f"histogram_quantile({q}, {buckets})"


# --- template variables -----------------------------------------------------------------------


def datasource_variable() -> Template:
    """``$datasource``: any Prometheus data source; the default one until a person picks."""
    return Template(
        name="datasource",
        label="Data source",
        query="prometheus",
        type="datasource",
        refresh=1,
        sort=SORT_ALPHA_ASC,
    )


def label_variable(name: str, label: str, query: str, *, numeric: bool = False) -> Template:
    """A multi-value variable over a label's values, with "All" (first, so picked on load).

    All is ``.+``, not Grafana's list of every value: the query stays short with hundreds
    of ranks, and series without the label (the daemon's own) stay out.
    """
    return Template(
        name=name,
        label=label,
        query=query,
        dataSource=DATASOURCE,
        multi=True,
        includeAll=True,
        allValue=".+",
        refresh=REFRESH_ON_TIME_RANGE_CHANGE,
        sort=SORT_NUMERIC_ASC if numeric else SORT_ALPHA_ASC,
    )


def run_variable() -> Template:
    """``$run``: the run ids of every process that exported its build info."""
    return label_variable("run", "Run", f"label_values({BUILD_INFO.name}, run)")


def rank_variable() -> Template:
    """``$rank``: the ranks of the runs picked in ``$run``."""
    query = f"label_values({selector(BUILD_INFO, matches('run', '$run'))}, rank)"
    return label_variable("rank", "Rank", query, numeric=True)


def gpu_variable() -> Template:
    """``$gpu``: the NVML indices of the GPUs the node daemons export."""
    query = f"label_values({GPU_UTILIZATION.name}, gpu)"
    return label_variable("gpu", "GPU", query, numeric=True)


# --- panels -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a panel and the legend of its series."""

    expr: str
    legend: str = ""
    instant: bool = False


def steps(base: str, *points: tuple[float, str]) -> list[dict[str, Any]]:
    """Threshold steps: ``base`` colour below the first point, then each ``(value, colour)``."""
    return [{"color": base, "value": None}] + [{"color": c, "value": v} for v, c in points]


def _targets(queries: Sequence[Query]) -> list[Target]:
    if not queries:
        raise ValueError("a panel needs at least one query")
    return [
        Target(
            expr=q.expr,
            legendFormat=q.legend,
            refId=chr(ord("A") + i),
            instant=q.instant,
            datasource=DATASOURCE,
            intervalFactor=1,
        )
        for i, q in enumerate(queries)
    ]


def timeseries(
    title: str,
    queries: Sequence[Query],
    *,
    unit: str,
    description: str,
    width: int = 8,
    height: int = 8,
    log_base: int | None = None,
    min_value: int | None = None,
    max_value: int | None = None,
    thresholds: Sequence[dict[str, Any]] = (),
    bars: bool = False,
    steps_after: bool = False,
    stacked: bool = False,
    legend_calcs: Sequence[str] = (),
) -> TimeSeries:
    """A time series panel; thresholds, when given, are drawn as dashed lines.

    ``bars`` suits event counts per interval, ``steps_after`` values that change in steps
    (epoch-end samples, 0/1 states), ``log_base`` values that span decades (gradient norms).
    """
    return TimeSeries(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=_targets(queries),
        gridPos=GridPos(h=height, w=width, x=0, y=0),
        maxDataPoints=None,
        unit=unit,
        valueMin=min_value,
        valueMax=max_value,
        scaleDistributionType="log" if log_base else "linear",
        scaleDistributionLog=log_base or 2,
        thresholds=list(thresholds) or steps("green"),
        thresholdsStyleMode="dashed" if thresholds else "off",
        drawStyle="bars" if bars else "line",
        fillOpacity=60 if bars or stacked else 10,
        lineInterpolation="stepAfter" if steps_after else "linear",
        showPoints="never",
        stacking={"mode": "normal", "group": "A"} if stacked else {"mode": "none"},
        legendDisplayMode="table" if legend_calcs else "list",
        legendCalcs=list(legend_calcs),
        tooltipMode="multi",
        tooltipSort="desc",
    )


def stat(
    title: str,
    queries: Sequence[Query],
    *,
    unit: str,
    description: str,
    thresholds: Sequence[dict[str, Any]],
    width: int = 4,
    height: int = 4,
    mappings: Sequence[dict[str, Any]] = (),
    text_mode: str = "auto",
    no_value: str = "no data",
) -> Stat:
    """A stat panel showing the last value, coloured by ``thresholds``."""
    return Stat(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=_targets(queries),
        gridPos=GridPos(h=height, w=width, x=0, y=0),
        maxDataPoints=None,
        format=unit,
        color={"mode": "thresholds"},
        thresholds=list(thresholds),
        mappings=list(mappings),
        reduceCalc="lastNotNull",
        colorMode="background",
        graphMode="none",
        textMode=text_mode,
        noValue=no_value,
    )


def value_text(*pairs: tuple[str, str, str]) -> list[dict[str, Any]]:
    """Value mappings: each ``(value, text, colour)`` shows that text in that colour."""
    options = {
        value: {"text": text, "color": color, "index": i}
        for i, (value, text, color) in enumerate(pairs)
    }
    return [{"type": "value", "options": options}]


def layout(*rows: tuple[str, Sequence[Panel]]) -> list[Panel]:
    """Rows of panels placed left to right, wrapping at the grid's width of 24."""
    placed: list[Panel] = []
    y = 0
    for title, row_panels in rows:
        placed.append(RowPanel(title=title, gridPos=GridPos(h=1, w=GRID_WIDTH, x=0, y=y)))
        y += 1
        x = 0
        line_height = 0
        for panel in row_panels:
            width, height = panel.gridPos.w, panel.gridPos.h
            if x + width > GRID_WIDTH:
                y, x, line_height = y + line_height, 0, 0
            placed.append(attr.evolve(panel, gridPos=GridPos(h=height, w=width, x=x, y=y)))
            x += width
            line_height = max(line_height, height)
        y += line_height
    return placed


def anomaly_annotation(expr: str, *, name: str = "Anomalies") -> dict[str, Any]:
    """A Prometheus annotation query: a marker wherever ``expr`` has a sample."""
    return {
        "datasource": DATASOURCE,
        "enable": True,
        "hide": False,
        "iconColor": "red",
        "name": name,
        "expr": expr,
        "step": "1m",
        "titleFormat": "{{kind}}",
        "textFormat": "run {{run}} rank {{rank}}",
        "tagKeys": "kind,run,rank",
        "useValueForTime": False,
    }
