"""Wrong-GPU detection from hand-made process samples and NVML process lists."""

from __future__ import annotations

import logging

import pytest
from helpers import value
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stabmon.contract import ANOMALY_KINDS
from stabmon.daemon.placement import (
    Mismatch,
    PlacementChecker,
    PlacementCollector,
    find_mismatches,
    process_gpu_memory,
)
from stabmon.daemon.processes import ProcessSample
from stabmon.shared.log import LogLimiter
from stabmon.shared.rundir import ProcessRecord

GPU0 = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
GPU1 = "GPU-5c1a2b3d-0000-4e5f-8a9b-1c2d3e4f5a6b"
MIG_ON_GPU1 = "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f"
IDENTITIES = {0: GPU0, 1: GPU1}
GiB = 2**30

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _sample(
    pid: int,
    rank: int,
    declared: tuple[str, ...],
    *,
    alive: bool = True,
    workers: tuple[int, ...] = (),
    visible: str | None = None,
) -> ProcessSample:
    record = ProcessRecord(
        pid=pid,
        create_time=1.0,
        run="job",
        rank=rank,
        gpu_uuids=declared,
        cuda_visible_devices=visible,
    )
    return ProcessSample(record, alive, False, 1.0, 0.0, 1.0, 0.0, None, worker_pids=workers)


def _mig_parent(uuid: str) -> str | None:
    return GPU1 if uuid.lower() == MIG_ON_GPU1.lower() else None


def _scrape(collector: PlacementCollector) -> Samples:
    registry = CollectorRegistry()
    registry.register(collector)
    samples: Samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def test_find_mismatches_flags_a_process_on_an_undeclared_gpu() -> None:
    samples = [_sample(100, 0, (GPU0,))]
    assert find_mismatches(samples, {0: [(100, GiB)], 1: [(100, 300)]}, IDENTITIES) == [
        Mismatch(rank=0, run="job", pid=100, gpu_index=1, uuid=GPU1, used_bytes=300,
                 declared=(GPU0,))
    ]  # fmt: skip


def test_find_mismatches_accepts_a_process_on_its_declared_gpu_in_any_case() -> None:
    samples = [_sample(100, 0, (GPU0.upper(),)), _sample(101, 1, (GPU1,))]
    assert find_mismatches(samples, {0: [(100, GiB)], 1: [(101, GiB)]}, IDENTITIES) == []


def test_find_mismatches_counts_a_declared_mig_instance_as_its_parent_gpu() -> None:
    samples = [_sample(100, 0, (MIG_ON_GPU1,))]
    gpus = {0: [(100, GiB)], 1: [(100, GiB)]}
    assert [m.gpu_index for m in find_mismatches(samples, gpus, IDENTITIES, _mig_parent)] == [0]


def test_find_mismatches_knows_a_mig_instance_declared_in_cudas_spelling() -> None:
    as_cuda_reports_it = "GPU-" + MIG_ON_GPU1.removeprefix("MIG-")
    samples = [_sample(100, 0, (as_cuda_reports_it,))]
    assert find_mismatches(samples, {1: [(100, GiB)]}, IDENTITIES, _mig_parent) == []
    assert len(find_mismatches(samples, {0: [(100, GiB)]}, IDENTITIES, _mig_parent)) == 1


def test_find_mismatches_never_flags_a_process_that_declared_nothing() -> None:
    samples = [_sample(100, 0, ())]
    assert find_mismatches(samples, {0: [(100, GiB)], 1: [(100, GiB)]}, IDENTITIES) == []


def test_find_mismatches_does_not_judge_declarations_naming_no_gpu_of_this_node() -> None:
    samples = [_sample(100, 0, ("GPU-00000000-1111-2222-3333-444444444444",))]
    assert find_mismatches(samples, {0: [(100, GiB)]}, IDENTITIES) == []


def test_find_mismatches_ignores_dead_and_unmonitored_processes() -> None:
    samples = [_sample(100, 0, (GPU0,), alive=False)]
    assert find_mismatches(samples, {1: [(100, GiB), (555, GiB)]}, IDENTITIES) == []


def test_find_mismatches_skips_a_gpu_nvml_could_not_name() -> None:
    samples = [_sample(100, 0, (GPU0,))]
    assert find_mismatches(samples, {7: [(100, GiB)]}, IDENTITIES) == []


def test_placement_checker_counts_each_mismatch_once_across_repeated_checks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stabmon")
    samples = [_sample(100, 0, (GPU0,)), _sample(101, 1, (GPU0,))]
    checker = PlacementChecker(limiter=LogLimiter())
    for _ in range(3):
        checker.check(find_mismatches(samples, {1: [(100, GiB)]}, IDENTITIES))
    assert checker.count == 1
    checker.check(find_mismatches(samples, {1: [(100, GiB), (101, GiB)]}, IDENTITIES))
    assert checker.count == 2
    logged = [r.getMessage() for r in caplog.records if "did not declare" in r.getMessage()]
    assert len(logged) == 2
    assert "pid 100" in logged[0] and GPU1 in logged[0]


def test_placement_checker_counts_a_reused_pid_again_after_its_process_exited() -> None:
    checker = PlacementChecker(limiter=LogLimiter())
    mismatch = find_mismatches([_sample(100, 0, (GPU0,))], {1: [(100, GiB)]}, IDENTITIES)
    checker.check(mismatch, alive_pids={100})
    checker.check([], alive_pids=set())
    checker.check(mismatch, alive_pids={100})
    assert checker.count == 2


def test_process_gpu_memory_lists_alive_monitored_processes_only() -> None:
    samples = [_sample(100, 0, (GPU0,)), _sample(101, 1, (GPU1,), alive=False)]
    gpus: dict[int, list[tuple[int, int | None]]] = {
        0: [(100, GiB), (101, GiB), (555, GiB)],
        1: [(100, None)],
    }
    assert process_gpu_memory(samples, gpus, IDENTITIES) == [
        ({"gpu": "0", "uuid": GPU0, "rank": "0", "pid": "100"}, float(GiB))
    ]


def test_process_gpu_memory_counts_a_process_listed_twice_on_one_gpu_once() -> None:
    samples = [_sample(100, 0, (GPU0,))]
    [(labels, used)] = process_gpu_memory(samples, {0: [(100, GiB), (100, GiB)]}, IDENTITIES)
    assert used == GiB


def test_placement_collector_exports_zero_mismatches_from_the_start() -> None:
    samples = _scrape(PlacementCollector(limiter=LogLimiter()))
    assert value(samples, "stabmon_anomalies_total", kind="device_mismatch") == 0
    assert "device_mismatch" in ANOMALY_KINDS
    assert value(samples, "stabmon_process_gpu_memory_bytes") is None


def test_placement_collector_exports_the_last_update() -> None:
    collector = PlacementCollector(limiter=LogLimiter())
    samples = [_sample(100, 3, (GPU0,))]
    for _ in range(2):
        collector.update(samples, {0: [(100, 2 * GiB)], 1: [(100, GiB)]}, IDENTITIES, _mig_parent)
    scraped = _scrape(collector)
    assert value(scraped, "stabmon_anomalies_total", kind="device_mismatch") == 1
    memory = {"rank": "3", "pid": "100"}
    assert value(scraped, "stabmon_process_gpu_memory_bytes", gpu="0", uuid=GPU0, **memory) == (
        2 * GiB
    )
    assert value(scraped, "stabmon_process_gpu_memory_bytes", gpu="1", uuid=GPU1, **memory) == GiB
    assert [m.gpu_index for m in collector.mismatches] == [1]
    collector.update(samples, {0: [(100, 2 * GiB)]}, IDENTITIES)
    assert collector.mismatches == []
    assert value(_scrape(collector), "stabmon_anomalies_total", kind="device_mismatch") == 1


def test_find_mismatches_flags_a_worker_on_a_gpu_its_process_did_not_declare() -> None:
    samples = [_sample(100, 0, (GPU1,), workers=(200, 201))]
    gpus = {0: [(201, 500)], 1: [(100, GiB), (200, GiB)]}
    assert find_mismatches(samples, gpus, IDENTITIES) == [
        Mismatch(rank=0, run="job", pid=201, gpu_index=0, uuid=GPU0, used_bytes=500,
                 declared=(GPU1,), worker_of=100)
    ]  # fmt: skip


def test_find_mismatches_ignores_the_workers_of_a_dead_process() -> None:
    samples = [_sample(100, 0, (GPU1,), alive=False, workers=(200,))]
    assert find_mismatches(samples, {0: [(200, GiB)]}, IDENTITIES) == []


def test_find_mismatches_holds_a_monitored_child_to_its_own_declaration() -> None:
    samples = [_sample(100, 0, (GPU1,), workers=(101,)), _sample(101, 1, (GPU0,))]
    assert find_mismatches(samples, {0: [(101, GiB)], 1: [(100, GiB)]}, IDENTITIES) == []


def test_process_gpu_memory_lists_a_workers_memory_under_its_pid_and_its_process_rank() -> None:
    samples = [_sample(100, 2, (GPU0,), workers=(200,))]
    assert process_gpu_memory(samples, {0: [(100, GiB), (200, 300)]}, IDENTITIES) == [
        ({"gpu": "0", "uuid": GPU0, "rank": "2", "pid": "100"}, float(GiB)),
        ({"gpu": "0", "uuid": GPU0, "rank": "2", "pid": "200"}, 300.0),
    ]


def test_placement_collector_counts_a_workers_mismatch_once_while_the_worker_lives() -> None:
    collector = PlacementCollector(limiter=LogLimiter())
    with_worker = [_sample(100, 0, (GPU1,), workers=(200,))]
    for _ in range(3):
        collector.update(with_worker, {0: [(200, GiB)]}, IDENTITIES)
    assert value(_scrape(collector), "stabmon_anomalies_total", kind="device_mismatch") == 1
    collector.update([_sample(100, 0, (GPU1,))], {}, IDENTITIES)  # the worker exited
    collector.update(with_worker, {0: [(200, GiB)]}, IDENTITIES)  # its pid, reused
    assert value(_scrape(collector), "stabmon_anomalies_total", kind="device_mismatch") == 2


def test_placement_checker_logs_a_workers_mismatch_naming_its_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stabmon")
    samples = [_sample(100, 0, (GPU1,), workers=(200,))]
    PlacementChecker(limiter=LogLimiter()).check(
        find_mismatches(samples, {0: [(200, GiB)]}, IDENTITIES)
    )
    [message] = [r.getMessage() for r in caplog.records if "did not declare" in r.getMessage()]
    assert "pid 200, a worker of pid 100" in message


def test_find_mismatches_resolves_cuda_visible_devices_when_no_uuids_were_declared() -> None:
    samples = [_sample(100, 0, (), visible="1")]
    assert find_mismatches(samples, {1: [(100, GiB)]}, IDENTITIES) == []
    assert find_mismatches(samples, {0: [(100, GiB)]}, IDENTITIES) == [
        Mismatch(rank=0, run="job", pid=100, gpu_index=0, uuid=GPU0, used_bytes=GiB,
                 declared=(GPU1,))
    ]  # fmt: skip


def test_find_mismatches_resolves_a_uuid_prefix_in_cuda_visible_devices() -> None:
    samples = [_sample(100, 0, (), visible=GPU0[:12])]
    gpus = {0: [(100, GiB)], 1: [(100, GiB)]}
    assert [m.gpu_index for m in find_mismatches(samples, gpus, IDENTITIES)] == [1]


def test_find_mismatches_resolves_a_mig_instance_in_cuda_visible_devices_to_its_parent() -> None:
    samples = [_sample(100, 0, (), visible=MIG_ON_GPU1)]
    gpus = {0: [(100, GiB)], 1: [(100, GiB)]}
    assert [m.gpu_index for m in find_mismatches(samples, gpus, IDENTITIES, _mig_parent)] == [0]


def test_find_mismatches_prefers_declared_uuids_over_cuda_visible_devices() -> None:
    samples = [_sample(100, 0, (GPU0,), visible="1")]
    assert [m.gpu_index for m in find_mismatches(samples, {1: [(100, GiB)]}, IDENTITIES)] == [1]


@pytest.mark.parametrize("visible", [None, "", "7"])
def test_find_mismatches_never_flags_a_cuda_visible_devices_that_names_no_gpu(
    visible: str | None,
) -> None:
    samples = [_sample(100, 0, (), visible=visible)]
    assert find_mismatches(samples, {0: [(100, GiB)], 1: [(100, GiB)]}, IDENTITIES) == []


def test_placement_collector_resolves_cuda_visible_devices_against_its_identities() -> None:
    collector = PlacementCollector(limiter=LogLimiter())
    collector.update([_sample(100, 0, (), visible="0")], {1: [(100, GiB)]}, IDENTITIES)
    assert [(m.gpu_index, m.declared) for m in collector.mismatches] == [(1, (GPU0,))]
    assert value(_scrape(collector), "stabmon_anomalies_total", kind="device_mismatch") == 1
