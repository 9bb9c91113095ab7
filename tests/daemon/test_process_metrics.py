"""stabmon.daemon.process_metrics: a poll's samples become the daemon's per-process families
(read through a real registry's exposition; the table is a stand-in holding fixed samples,
the real one is tested against real processes in tests/daemon/test_processes.py)."""

from __future__ import annotations

from typing import Any, cast

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stabmon.daemon.process_metrics import ProcessCollector, ProcessSample
from stabmon.shared.rundir import ProcessRecord


class _Table:
    def __init__(self, samples: list[ProcessSample]) -> None:
        self._samples = samples

    def samples(self) -> list[ProcessSample]:
        return self._samples


def _record(rank: int, pid: int) -> ProcessRecord:
    return ProcessRecord(pid=pid, create_time=1.0, run="job", rank=rank)


def _scrape(samples: list[ProcessSample]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProcessCollector(cast(Any, _Table(samples))))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_live_process_exports_up_age_cpu_and_memory_of_both_scopes() -> None:
    live = ProcessSample(_record(0, 100), True, False, 2.0, 3.0, 100.0, 50.0, 1.5)
    found = _scrape([live])
    assert found[("stabmon_process_up", (("pid", "100"), ("rank", "0"), ("run", "job")))] == 1.0
    assert found[("stabmon_heartbeat_age_seconds", (("rank", "0"), ("run", "job")))] == 1.5
    cpu = "stabmon_process_cpu_seconds_total"
    assert found[(cpu, (("rank", "0"), ("run", "job"), ("scope", "workers")))] == 3.0
    memory = "stabmon_process_memory_bytes"
    assert found[(memory, (("rank", "0"), ("run", "job"), ("scope", "main")))] == 100.0


def test_a_dead_process_exports_down_and_its_age_but_no_memory() -> None:
    dead = ProcessSample(_record(1, 200), False, False, None, None, None, None, 30.0)
    found = _scrape([dead])
    assert found[("stabmon_process_up", (("pid", "200"), ("rank", "1"), ("run", "job")))] == 0.0
    assert found[("stabmon_heartbeat_age_seconds", (("rank", "1"), ("run", "job")))] == 30.0
    assert not any(name == "stabmon_process_memory_bytes" for name, _ in found)
