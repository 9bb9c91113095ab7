"""stabmon.export.collector: Readings and plug-in readings as metric families, read
through a real HTTP scrape of a real Exporter on port 0 and parsed with
prometheus_client's parser."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import pytest
from helpers import scrape, value
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from stabmon import contract as c
from stabmon.export.collector import (
    MAX_LABEL_CHARS,
    PluginCollector,
    ReadingsCollector,
    bounded_label,
)
from stabmon.export.exporter import Exporter
from stabmon.pipeline.readings import DeviceMemory, Readings
from stabmon.shared.log import LogLimiter

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
LABELS = {"rank": "0", "run": "job"}


@pytest.fixture
def serve() -> Iterator[Callable[[Collector], str]]:
    """Serve one collector from a fresh registry on a real port; the scrape URL."""
    exporters: list[Exporter] = []

    def start(collector: Collector) -> str:
        registry = CollectorRegistry()
        registry.register(collector)
        exporter = Exporter(registry, address="127.0.0.1", ports=[0], limiter=LogLimiter())
        assert exporter.start()
        exporters.append(exporter)
        url = exporter.url
        assert url is not None
        return url

    yield start
    for exporter in exporters:
        exporter.stop()


def _names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def test_unmeasured_gauges_are_left_out_rather_than_exported_as_zero(
    serve: Callable[[Collector], str],
) -> None:
    samples = scrape(serve(ReadingsCollector(Readings(labels=LABELS), {})))
    for absent in (c.LOSS, c.GRAD_NORM, c.AMP_LOSS_SCALE, c.HOST_MEMORY_RSS, c.MFU):
        assert absent.name not in _names(samples)
    assert value(samples, c.STEPS.name, **LABELS) == 0.0
    assert value(samples, c.STALLED.name, **LABELS) == 0.0


def test_a_scrape_shows_what_the_readings_hold_now_with_process_labels(
    serve: Callable[[Collector], str],
) -> None:
    readings = Readings(labels=LABELS)
    url = serve(ReadingsCollector(readings, {"hooks": 2}))
    readings.steps = 7
    readings.loss = 0.25
    readings.count_anomaly("loss_spike")
    readings.step_duration.observe(0.3)
    samples = scrape(url)
    assert value(samples, c.STEPS.name, **LABELS) == 7.0
    assert value(samples, c.LOSS.name, **LABELS) == 0.25
    assert value(samples, c.ANOMALIES.name, kind="loss_spike", **LABELS) == 1.0
    assert value(samples, c.INTERNAL_ERRORS.name, component="hooks", **LABELS) == 2.0
    assert value(samples, f"{c.STEP_DURATION.name}_bucket", le="0.5", **LABELS) == 1.0
    assert value(samples, f"{c.STEP_DURATION.name}_bucket", le="0.25", **LABELS) == 0.0
    assert value(samples, f"{c.STEP_DURATION.name}_count", **LABELS) == 1.0


def test_the_allocator_cache_is_reserved_minus_allocated_per_device(
    serve: Callable[[Collector], str],
) -> None:
    readings = Readings(labels=LABELS)
    readings.device_memory["cuda:0"] = DeviceMemory(allocated=3e9, reserved=5e9)
    samples = scrape(serve(ReadingsCollector(readings, {})))
    assert value(samples, c.DEVICE_MEMORY_CACHE.name, device="cuda:0", **LABELS) == 2e9
    assert value(samples, c.DEVICE_MEMORY_RESERVED.name, device="cuda:0", **LABELS) == 5e9


def test_device_timing_families_are_absent_without_cuda_and_present_with_it(
    serve: Callable[[Collector], str],
) -> None:
    readings = Readings(labels=LABELS)
    url = serve(ReadingsCollector(readings, {}))
    assert c.DEVICE_PHASE_SECONDS.name not in _names(scrape(url))
    readings.add_device_phase_time("forward", 0.5)
    samples = scrape(url)
    assert value(samples, c.DEVICE_PHASE_SECONDS.name, phase="forward", **LABELS) == 0.5


def test_mfu_is_exported_only_with_a_known_peak(serve: Callable[[Collector], str]) -> None:
    readings = Readings(labels=LABELS)
    readings.mfu = 0.4
    url = serve(ReadingsCollector(readings, {}))
    assert c.MFU.name not in _names(scrape(url))
    readings.peak_flops = 1e15
    assert value(scrape(url), c.MFU.name, **LABELS) == 0.4


def test_a_long_module_name_is_cut_to_a_bounded_label_that_stays_unique(
    serve: Callable[[Collector], str],
) -> None:
    head = "encoder." * 40
    readings = Readings(labels=LABELS)
    readings.dead_grad_params = {head + "a": 1, head + "b": 2}
    samples = scrape(serve(ReadingsCollector(readings, {})))
    modules = {
        dict(labels)["module"] for name, labels in samples if name == c.DEAD_GRAD_PARAMS.name
    }
    assert len(modules) == 2
    assert all(len(module) <= MAX_LABEL_CHARS for module in modules)
    assert all(module.startswith(head[:100]) for module in modules)


def test_bounded_label_keeps_a_short_value_as_it_is() -> None:
    assert bounded_label("encoder.layer.0") == "encoder.layer.0"
    assert bounded_label("x" * MAX_LABEL_CHARS) == "x" * MAX_LABEL_CHARS
    assert bounded_label("x" * (MAX_LABEL_CHARS + 1)) != bounded_label("x" * (MAX_LABEL_CHARS + 2))


class _LearningRate:
    """A plug-in that publishes one family, as stabmon.extension's Publishes asks."""

    component = "learning_rate"
    definition = c.MetricDef("stabmon_test_learning_rate", "gauge", "Test family.", ("group",))

    def readings(self) -> Iterable[tuple[c.MetricDef, Iterable[tuple[Sequence[str], float]]]]:
        return [(self.definition, [(("0",), 0.125), (("1",), 0.5)])]


def test_a_plugins_family_carries_the_process_labels_first(
    serve: Callable[[Collector], str],
) -> None:
    samples = scrape(serve(PluginCollector(LABELS, _LearningRate())))
    assert value(samples, "stabmon_test_learning_rate", group="0", **LABELS) == 0.125
    assert value(samples, "stabmon_test_learning_rate", group="1", **LABELS) == 0.5
