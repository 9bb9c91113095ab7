"""Turns a process's :class:`~stabmon.pipeline.readings.Readings` into metric families at
scrape time.

Scrape-time collection keeps prometheus-client off the training thread: hooks
write plain numbers, and this collector, running in the exporter's thread,
builds the families from them. Every name, type, help text and label comes
from :mod:`stabmon.contract`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from stabmon import contract as c
from stabmon.export.families import family, histogram_family
from stabmon.extension import Publishes
from stabmon.pipeline.readings import Histogram, Readings

__all__ = ["PluginCollector", "ReadingsCollector"]


class ReadingsCollector(Collector):
    """The training-process metric families of one Monitor."""

    def __init__(self, readings: Readings, internal_errors: Mapping[str, int]) -> None:
        self._readings = readings
        self._internal_errors = internal_errors

    def collect(self) -> Iterator[Metric]:
        r = self._readings
        info = r.build_info
        yield _gauge(c.BUILD_INFO, r.labels, [(tuple(info.values()), 1.0)], tuple(info))
        if r.device_info:
            names = c.DEVICE_INFO.labels
            yield _gauge(
                c.DEVICE_INFO,
                r.labels,
                [(tuple(info.get(name, "") for name in names), 1.0) for info in r.device_info],
            )
        yield _counter(c.STEPS, r.labels, [((), r.steps)])
        yield _gauge(c.EPOCH, r.labels, [((), r.epoch)])
        yield _gauge(c.LAST_STEP_TIMESTAMP, r.labels, _optional(r.last_step_unix))
        yield _histogram(c.STEP_DURATION, r.labels, r.step_duration)
        yield _histogram(c.DATA_WAIT, r.labels, r.data_wait)
        yield _counter(c.PHASE_SECONDS, r.labels, _by_key(r.phase_seconds))
        yield _gauge(c.GRAD_NORM, r.labels, _optional(r.grad_norm))
        yield _gauge(c.GRAD_NORM_SQUARED, r.labels, _by_key(r.grad_norm_squared))
        yield _gauge(c.MODULE_GRAD_NORM, r.labels, _by_key(r.module_grad_norms))
        yield _counter(c.NONFINITE_GRAD_STEPS, r.labels, [((), r.nonfinite_grad_steps)])
        yield _counter(c.GRAD_CLIPPED_STEPS, r.labels, [((), r.grad_clipped_steps)])
        yield _gauge(c.GRAD_CLIP_COEFFICIENT, r.labels, _optional(r.grad_clip_coefficient))
        yield _gauge(c.MEMORY_EXHAUSTION, r.labels, _by_key(r.memory_exhaustion_seconds))
        yield _counter(c.NONFINITE_LOSS, r.labels, [((), r.nonfinite_losses)])
        yield _gauge(c.ZERO_GRAD_PARAMS, r.labels, _optional(r.zero_grad_params))
        yield _gauge(c.DEAD_GRAD_PARAMS, r.labels, _by_key(r.dead_grad_params))
        yield _gauge(c.LOSS, r.labels, _optional(r.loss))
        yield _counter(c.ANOMALIES, r.labels, _by_key(r.anomalies))
        yield _gauge(c.AMP_LOSS_SCALE, r.labels, _optional(r.amp_loss_scale))
        yield _counter(c.AMP_SKIPPED_STEPS, r.labels, _optional(r.amp_skipped_steps))
        yield from self._memory()
        yield _gauge(c.STALLED, r.labels, [((), r.stalled)])
        yield _counter(c.INTERNAL_ERRORS, r.labels, _by_key(self._internal_errors))
        yield from self._device_and_throughput()

    def _memory(self) -> Iterator[Metric]:
        r = self._readings
        memory = dict(r.device_memory)
        yield _gauge(
            c.DEVICE_MEMORY_ALLOCATED,
            r.labels,
            [((device,), m.allocated) for device, m in memory.items()],
        )
        yield _gauge(
            c.DEVICE_MEMORY_RESERVED,
            r.labels,
            [((device,), m.reserved) for device, m in memory.items()],
        )
        yield _gauge(
            c.DEVICE_MEMORY_CACHE,
            r.labels,
            [((device,), m.reserved - m.allocated) for device, m in memory.items()],
        )
        yield _gauge(c.DEVICE_MEMORY_PEAK, r.labels, _by_key(r.device_memory_peak))
        yield _gauge(c.EPOCH_MEMORY, r.labels, _by_key(r.epoch_memory))
        yield _gauge(c.MEMORY_DRIFT, r.labels, _by_key(r.memory_drift))
        yield _gauge(c.MEMORY_LEAK_SUSPECTED, r.labels, _by_key(r.memory_leak_suspected))
        yield _gauge(c.HOST_MEMORY_RSS, r.labels, _optional(r.host_rss))

    def _device_and_throughput(self) -> Iterator[Metric]:
        r = self._readings
        if r.device_utilization:
            yield _gauge(c.DEVICE_UTILIZATION, r.labels, _by_key(r.device_utilization))
        if r.device_phase_seconds:  # CUDA only: absent rather than a misleading 0 on CPU
            yield _counter(c.DEVICE_PHASE_SECONDS, r.labels, _by_key(r.device_phase_seconds))
            yield _histogram(c.DEVICE_STEP_DURATION, r.labels, r.device_step_duration)
        yield _counter(c.SAMPLES, r.labels, [((), r.samples)])
        yield _counter(c.TOKENS, r.labels, [((), r.tokens)])
        yield _counter(c.MODEL_FLOPS, r.labels, _optional(r.model_flops))
        yield _gauge(c.PEAK_FLOPS, r.labels, _optional(r.peak_flops))
        yield _gauge(c.MFU, r.labels, _optional(r.mfu if r.peak_flops else None))
        yield _gauge(c.SLOWDOWN_ACTIVE, r.labels, _by_key(r.slowdown_active))
        yield _gauge(c.STEP_TIME_BASELINE, r.labels, _optional(r.step_time_baseline))


Samples = Iterable[tuple[tuple[str, ...], float]]

#: Longest label value exported; module names and run ids come from user code.
MAX_LABEL_CHARS = 128


def bounded_label(value: str) -> str:
    """``value``, or its head plus a hash of the whole when longer than ``MAX_LABEL_CHARS``.

    The hash keeps two long names that share a head apart (no duplicate series);
    prometheus-client escapes quotes, backslashes and newlines at exposition.
    """
    if len(value) <= MAX_LABEL_CHARS:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{value[: MAX_LABEL_CHARS - 18]}~{digest}"


def _values(base: tuple[str, ...], values: Iterable[str]) -> list[str]:
    return [bounded_label(str(item)) for item in (*base, *values)]


def _optional(value: float | None) -> Samples:
    return [] if value is None else [((), value)]


def _by_key(values: Mapping[str, float]) -> Samples:
    return [((key,), value) for key, value in dict(values).items()]  # copy: writers go on


def _gauge(
    definition: c.MetricDef,
    labels: Mapping[str, str],
    samples: Samples,
    extra_labels: tuple[str, ...] | None = None,
) -> CounterMetricFamily | GaugeMetricFamily:
    return _process_family(definition, labels, samples, extra_labels)


def _counter(
    definition: c.MetricDef, labels: Mapping[str, str], samples: Samples
) -> CounterMetricFamily | GaugeMetricFamily:
    return _process_family(definition, labels, samples, None)


def _process_family(
    definition: c.MetricDef,
    labels: Mapping[str, str],
    samples: Samples,
    extra_labels: tuple[str, ...] | None,
) -> CounterMetricFamily | GaugeMetricFamily:
    """``definition``'s family with the process labels (``rank``, ``run``) first."""
    extra = definition.labels if extra_labels is None else extra_labels
    base = tuple(labels.values())
    with_process = ((_values(base, values), value) for values, value in samples)
    return family(definition, with_process, labels=[*labels, *extra])


def _histogram(
    definition: c.MetricDef, labels: Mapping[str, str], histogram: Histogram
) -> HistogramMetricFamily:
    built = histogram_family(definition, labels=list(labels))
    buckets, total = histogram.snapshot()
    built.add_metric(_values(tuple(labels.values()), ()), buckets, total)
    return built


class PluginCollector(Collector):
    """The families a plug-in publishes (:mod:`stabmon.extension`'s ``readings()``), with
    the process labels (``rank``, ``run``) first."""

    def __init__(self, labels: Mapping[str, str], plugin: Publishes) -> None:
        self._labels = labels
        self._plugin = plugin

    def collect(self) -> Iterator[Metric]:
        for definition, samples in self._plugin.readings():
            rows = ((tuple(values), value) for values, value in samples)
            yield _process_family(definition, self._labels, rows, None)
