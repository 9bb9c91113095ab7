"""The one contract-row-to-family builder and the registry sum."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from stabmon import contract
from stabmon.export.families import family, histogram_family, registry_sum


class _Fixed(Collector):
    def __init__(self, *families: object) -> None:
        self._families = families

    def collect(self):  # type: ignore[no-untyped-def]
        yield from self._families


def _scrape(*families: object) -> str:
    registry = CollectorRegistry()
    registry.register(_Fixed(*families))
    return generate_latest(registry).decode()


def test_family_takes_type_help_and_labels_from_the_contract_row() -> None:
    text = _scrape(family(contract.INTERNAL_ERRORS, [(["nvml"], 2)]))
    assert "# TYPE stabmon_internal_errors_total counter" in text
    assert f"# HELP stabmon_internal_errors_total {contract.INTERNAL_ERRORS.help}" in text
    assert 'stabmon_internal_errors_total{component="nvml"} 2.0' in text


def test_family_puts_caller_labels_in_the_order_given() -> None:
    built = family(contract.ANOMALIES, [(["0", "r", "stall"], 1)], labels=["rank", "run", "kind"])
    assert 'stabmon_anomalies_total{kind="stall",rank="0",run="r"} 1.0' in _scrape(built)


def test_family_without_labels_serves_one_plain_sample() -> None:
    text = _scrape(family(contract.HOST_MEMORY_TOTAL, [((), 8.0)]))
    assert f"{contract.HOST_MEMORY_TOTAL.name} 8.0" in text.splitlines()


def test_family_refuses_a_histogram_and_histogram_family_a_gauge() -> None:
    with pytest.raises(ValueError, match="histogram_family"):
        family(contract.STEP_DURATION)
    with pytest.raises(ValueError, match=r"family\(\)"):
        histogram_family(contract.GRAD_NORM)
    assert histogram_family(contract.STEP_DURATION).type == "histogram"


def test_registry_sum_adds_the_samples_whose_labels_match() -> None:
    registry = CollectorRegistry()
    errors = family(contract.INTERNAL_ERRORS, [(["a"], 2), (["b"], 3)])
    registry.register(_Fixed(errors))
    assert registry_sum(registry, "stabmon_internal_errors_total") == 5
    assert registry_sum(registry, "stabmon_internal_errors_total", component="b") == 3
    assert registry_sum(registry, "stabmon_no_such_metric") == 0
