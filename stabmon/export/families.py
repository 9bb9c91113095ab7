"""Contract row to Prometheus family: the one builder, and the one way to read a registry back.

Every family stabmon serves, from a training process or the node daemon, is built
here from its :class:`~stabmon.contract.MetricDef`: the type picks the family class,
the name, help and label names come from the row. A caller that adds labels of its
own (the training process puts ``rank`` and ``run`` first) passes the full list.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from stabmon.contract import MetricDef

__all__ = ["family", "histogram_family", "registry_sum"]

#: Label values and the value of one sample.
Samples = Iterable[tuple[Sequence[str], float]]


def family(
    definition: MetricDef, samples: Samples = (), *, labels: Sequence[str] | None = None
) -> CounterMetricFamily | GaugeMetricFamily:
    """The counter or gauge family of ``definition``, holding ``samples``.

    ``labels`` names the labels, in the order of each sample's values; by default the
    contract row's own (``definition.labels``). A histogram has its own builder,
    :func:`histogram_family`, because its samples are buckets, not one value.
    """
    names = list(definition.labels if labels is None else labels)
    built: CounterMetricFamily | GaugeMetricFamily
    if definition.type == "counter":
        built = CounterMetricFamily(definition.name, definition.help, labels=names)
    elif definition.type == "gauge":
        built = GaugeMetricFamily(definition.name, definition.help, labels=names)
    else:
        raise ValueError(
            f"{definition.name} is a {definition.type}: build it with histogram_family()"
        )
    for values, value in samples:
        built.add_metric(list(values), float(value))
    return built


def histogram_family(
    definition: MetricDef, *, labels: Sequence[str] | None = None
) -> HistogramMetricFamily:
    """The (empty) histogram family of ``definition``; add buckets with ``add_metric``."""
    if definition.type != "histogram":
        raise ValueError(f"{definition.name} is a {definition.type}: build it with family()")
    names = list(definition.labels if labels is None else labels)
    return HistogramMetricFamily(definition.name, definition.help, labels=names)


def registry_sum(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of every sample called ``name`` whose labels include ``labels``.

    What a scrape would show, read without HTTP: a Monitor without an endpoint (the
    demo, the benchmarks) reads its counters this way.
    """
    return sum(
        sample.value
        for collected in registry.collect()
        for sample in collected.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )
