"""GpuPoller and GpuCollector against FakeNvml, read through a real registry and parser.

(Named ``test_daemon_gpu.py``: ``tests/test_gpu.py`` already holds the basename
``test_gpu``, and without ``__init__.py`` files pytest cannot import both.)
"""

from __future__ import annotations

import logging

import pytest
from fake_nvml import FakeGpu, FakeNvml
from helpers import value
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stabmon.contract import THROTTLE_REASONS
from stabmon.daemon.gpu import GpuCollector, GpuPoller
from stabmon.hardware.nvml import GpuProcess, GpuReading, NvmlError, NvmlReader
from stabmon.shared.log import LogLimiter

UUID_0 = "GPU-5f2c0a4e-1b2c-3d4e-5f60-718293a4b5c6"
UUID_1 = "GPU-8e2d7f15-5a1b-5c3d-9e4f-0a1b2c3d4e5f"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _poller(reader: NvmlReader, clock: Clock | None = None) -> GpuPoller:
    return GpuPoller(reader, limiter=LogLimiter(), clock=clock or Clock())


def _scrape(poller: GpuPoller, collector: GpuCollector | None = None) -> Samples:
    registry = CollectorRegistry()
    registry.register(collector or GpuCollector(poller))
    samples: Samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def _gpu_series(samples: Samples) -> list[str]:
    return [name for name, _ in samples if name.startswith("stabmon_gpu_")]


def _two_gpus() -> FakeNvml:
    return FakeNvml([FakeGpu(UUID_0), FakeGpu(UUID_1)])


def test_gpu_collector_exports_readings_in_si_units_with_gpu_and_uuid_labels() -> None:
    fake = FakeNvml(
        [
            FakeGpu(UUID_0),
            FakeGpu(
                UUID_1,
                utilization_percent=57,
                memory_used_bytes=30 * 2**30,
                memory_total_bytes=80 * 2**30,
                temperature_celsius=71,
                power_milliwatts=250_000,
                sm_clock_mhz=1980,
            ),
        ]
    )
    poller = _poller(fake)
    poller.poll()
    samples = _scrape(poller)
    gpu = {"gpu": "1", "uuid": UUID_1}
    assert value(samples, "stabmon_daemon_nvml_up") == 1
    assert value(samples, "stabmon_gpu_utilization_ratio", **gpu) == pytest.approx(0.57)
    assert value(samples, "stabmon_gpu_memory_used_bytes", **gpu) == 30 * 2**30
    assert value(samples, "stabmon_gpu_memory_total_bytes", **gpu) == 80 * 2**30
    assert value(samples, "stabmon_gpu_temperature_celsius", **gpu) == 71.0
    assert value(samples, "stabmon_gpu_power_watts", **gpu) == 250.0
    assert value(samples, "stabmon_gpu_sm_clock_hertz", **gpu) == pytest.approx(1.98e9)
    assert value(samples, "stabmon_gpu_power_watts", gpu="0", uuid=UUID_0) == 70.0


def test_gpu_poller_leaves_out_a_failing_gpu_keeps_the_others_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = _two_gpus()
    fake.gpus[1].fails = True
    poller = _poller(fake)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        for _ in range(3):
            poller.poll()
    samples = _scrape(poller)
    assert value(samples, "stabmon_daemon_nvml_up") == 1
    assert value(samples, "stabmon_gpu_utilization_ratio", gpu="0") == 0.0
    assert value(samples, "stabmon_gpu_utilization_ratio", gpu="1") is None
    assert [r.getMessage() for r in caplog.records if UUID_1 in r.getMessage()] == [
        f"stabmon daemon: GPU 1 ({UUID_1}) left out of the metrics while it fails: "
        "nvmlDeviceGetUtilizationRates failed: GPU is lost"
    ]


def test_gpu_poller_brings_a_failing_gpu_back_when_it_answers_again() -> None:
    fake = _two_gpus()
    fake.gpus[1].fails = True
    poller = _poller(fake)
    poller.poll()
    fake.gpus[1].fails = False
    poller.poll()
    assert value(_scrape(poller), "stabmon_gpu_utilization_ratio", gpu="1") == 0.0


def test_gpu_collector_leaves_out_unsupported_fields_instead_of_exporting_zero() -> None:
    fake = FakeNvml([FakeGpu(UUID_0, unsupported={"power_watts", "ecc_corrected"})])
    poller = _poller(fake)
    poller.poll()
    samples = _scrape(poller)
    assert value(samples, "stabmon_gpu_power_watts") is None
    assert value(samples, "stabmon_gpu_ecc_errors_total", type="corrected") is None
    assert value(samples, "stabmon_gpu_ecc_errors_total", type="uncorrected") == 0
    assert value(samples, "stabmon_gpu_temperature_celsius") == 35.0


def test_gpu_collector_exports_every_throttle_reason_as_0_or_1() -> None:
    fake = FakeNvml([FakeGpu(UUID_0, throttle_bitmask=0x04 | 0x40)])  # SwPowerCap, HwThermal
    poller = _poller(fake)
    poller.poll()
    samples = _scrape(poller)
    exported = {
        reason: value(samples, "stabmon_gpu_throttle_active", gpu="0", uuid=UUID_0, reason=reason)
        for reason in THROTTLE_REASONS
    }
    active = {"sw_power_cap", "hw_thermal_slowdown"}
    assert exported == {reason: float(reason in active) for reason in THROTTLE_REASONS}


def test_gpu_collector_leaves_out_throttle_reasons_when_unsupported() -> None:
    fake = FakeNvml([FakeGpu(UUID_0, unsupported={"throttle_reasons"})])
    poller = _poller(fake)
    poller.poll()
    samples = _scrape(poller)
    assert [name for name, _ in samples if name == "stabmon_gpu_throttle_active"] == []


def test_gpu_collector_exports_ecc_counters_by_type() -> None:
    fake = FakeNvml([FakeGpu(UUID_0, ecc_corrected=3, ecc_uncorrected=1)])
    poller = _poller(fake)
    poller.poll()
    samples = _scrape(poller)
    ecc = "stabmon_gpu_ecc_errors_total"
    assert value(samples, ecc, gpu="0", uuid=UUID_0, type="corrected") == 3
    assert value(samples, ecc, gpu="0", uuid=UUID_0, type="uncorrected") == 1


def test_gpu_collector_exports_xid_counts_with_gpu_uuid_and_xid_labels() -> None:
    poller = _poller(_two_gpus())
    poller.poll()
    collector = GpuCollector(poller, lambda: {(1, UUID_1, 79): 2})
    samples = _scrape(poller, collector)
    xid = "stabmon_gpu_xid_errors_total"
    assert value(samples, xid, gpu="1", uuid=UUID_1, xid="79") == 2
    assert value(samples, xid, gpu="0") is None  # children appear with a GPU's first XID


def test_gpu_poller_reports_nvml_down_without_a_driver(caplog: pytest.LogCaptureFixture) -> None:
    poller = _poller(FakeNvml([FakeGpu(UUID_0)], available=False))
    with caplog.at_level(logging.INFO, logger="stabmon"):
        poller.poll()
    samples = _scrape(poller)
    assert not poller.nvml_up
    assert value(samples, "stabmon_daemon_nvml_up") == 0
    assert _gpu_series(samples) == []
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # a CPU node is not a problem
    assert "no GPU telemetry: nvmlInit failed" in caplog.records[0].getMessage()


def test_gpu_poller_reports_nvml_down_when_nvml_fails_mid_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = _two_gpus()
    poller = _poller(fake)
    poller.poll()
    fake.failing = True
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        poller.poll()
        poller.poll()
    samples = _scrape(poller)
    assert value(samples, "stabmon_daemon_nvml_up") == 0
    assert _gpu_series(samples) == []
    assert len([r for r in caplog.records if "NVML stopped answering" in r.getMessage()]) == 1


def test_gpu_poller_reinitialises_nvml_at_most_every_60_seconds_after_a_failure() -> None:
    fake, clock = _two_gpus(), Clock()
    poller = _poller(fake, clock)
    poller.poll()
    fake.failing = True
    poller.poll()
    fake.failing = False
    clock.now += 59.0
    poller.poll()
    assert not poller.nvml_up
    clock.now += 1.0
    poller.poll()
    assert poller.nvml_up
    assert value(_scrape(poller), "stabmon_gpu_utilization_ratio", gpu="1") == 0.0
    assert fake.calls.count("nvmlInit") == 2


def test_gpu_poller_retries_a_failed_init_at_most_every_60_seconds() -> None:
    fake, clock = FakeNvml([FakeGpu(UUID_0)], available=False), Clock()
    poller = _poller(fake, clock)
    poller.poll()
    clock.now += 30.0
    poller.poll()
    assert fake.calls.count("nvmlInit") == 1
    fake.available = True
    clock.now += 30.0
    poller.poll()
    assert fake.calls.count("nvmlInit") == 2
    assert poller.nvml_up


def test_gpu_collector_scrape_makes_no_nvml_calls() -> None:
    fake = _two_gpus()
    poller = _poller(fake)
    poller.poll()
    calls = len(fake.calls)
    registry = CollectorRegistry()
    registry.register(GpuCollector(poller))
    for _ in range(10):
        generate_latest(registry)
    assert len(fake.calls) == calls


def test_gpu_poller_snapshot_exposes_processes_by_gpu_index() -> None:
    fake = _two_gpus()
    fake.gpus[1].processes = [GpuProcess(4242, 2**30), GpuProcess(4243, None)]
    poller = _poller(fake)
    poller.poll()
    snapshot = poller.snapshot()
    assert snapshot.processes[0] == ()
    assert snapshot.processes[1] == (GpuProcess(4242, 2**30), GpuProcess(4243, None))
    assert [gpu.uuid for gpu in snapshot.identities] == [UUID_0, UUID_1]


def test_gpu_poller_close_shuts_nvml_down() -> None:
    fake = _two_gpus()
    poller = _poller(fake)
    poller.poll()
    poller.close()
    assert fake.calls[-1] == "nvmlShutdown"
    assert not poller.nvml_up


def test_gpu_poller_lets_unexpected_errors_reach_the_callers_guard() -> None:
    class BrokenReading(FakeNvml):
        def reading(self, index: int) -> GpuReading:
            raise ZeroDivisionError("a bug, not an NVML failure")

    poller = _poller(BrokenReading([FakeGpu(UUID_0)]))
    with pytest.raises(ZeroDivisionError, match="a bug"):
        poller.poll()


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_gpu_poller_keeps_the_other_gpus_when_one_identity_cannot_be_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([FakeGpu(UUID_0), FakeGpu(UUID_1)], fail_calls={0: {"identity"}})
    poller = _poller(fake)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        for _ in range(3):
            poller.poll()
    samples = _scrape(poller)
    assert value(samples, "stabmon_daemon_nvml_up") == 1
    assert value(samples, "stabmon_gpu_utilization_ratio", gpu="0") is None
    assert value(samples, "stabmon_gpu_utilization_ratio", gpu="1", uuid=UUID_1) == 0.0
    assert _warnings(caplog, "GPU 0") == [
        "stabmon daemon: GPU 0 left out of the metrics: nvmlDeviceGetUUID failed: "
        "Insufficient Permissions; retrying every 60 s"
    ]


def test_gpu_poller_names_a_skipped_gpu_again_at_most_every_60_seconds() -> None:
    fake, clock = _two_gpus(), Clock()
    fake.fail_calls[0] = {"identity"}
    poller = _poller(fake, clock)
    poller.poll()
    fake.fail_calls.clear()
    clock.now += 59.0
    poller.poll()
    assert [gpu.index for gpu in poller.snapshot().identities] == [1]
    clock.now += 1.0
    poller.poll()
    assert [gpu.uuid for gpu in poller.snapshot().identities] == [UUID_0, UUID_1]
    assert value(_scrape(poller), "stabmon_gpu_utilization_ratio", gpu="0", uuid=UUID_0) == 0.0


def test_gpu_collector_leaves_out_only_the_field_whose_call_fails_and_logs_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([FakeGpu(UUID_0)], fail_calls={0: {"power", "ecc"}})
    poller = _poller(fake)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        for _ in range(3):
            poller.poll()
    samples = _scrape(poller)
    assert value(samples, "stabmon_gpu_power_watts") is None
    assert value(samples, "stabmon_gpu_ecc_errors_total", type="corrected") is None
    assert value(samples, "stabmon_gpu_temperature_celsius", gpu="0", uuid=UUID_0) == 35.0
    assert value(samples, "stabmon_gpu_utilization_ratio", gpu="0", uuid=UUID_0) == 0.0
    assert sorted(_warnings(caplog, UUID_0)) == [
        f"stabmon daemon: GPU 0 ({UUID_0}): nvmlDeviceGetPowerUsage failed: "
        "Insufficient Permissions; that reading is left out while it fails",
        f"stabmon daemon: GPU 0 ({UUID_0}): nvmlDeviceGetTotalEccErrors failed: "
        "Insufficient Permissions; that reading is left out while it fails",
    ]


def test_gpu_poller_keeps_a_gpus_readings_when_its_process_query_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = _two_gpus()
    fake.gpus[0].processes = [GpuProcess(4242, 2**30)]
    fake.gpus[1].processes = [GpuProcess(4243, 2**30)]
    fake.fail_calls[1] = {"processes"}
    poller = _poller(fake)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        poller.poll()
        poller.poll()
    snapshot = poller.snapshot()
    assert snapshot.processes == {0: (GpuProcess(4242, 2**30),), 1: ()}
    assert set(snapshot.readings) == {0, 1}
    assert value(_scrape(poller), "stabmon_gpu_utilization_ratio", gpu="1", uuid=UUID_1) == 0.0
    assert _warnings(caplog, UUID_1) == [
        f"stabmon daemon: GPU 1 ({UUID_1}): nvmlDeviceGetComputeRunningProcesses failed: "
        "Insufficient Permissions; its process list is empty while it fails"
    ]


def test_gpu_poller_leaves_out_a_gpu_whose_process_query_finds_it_lost() -> None:
    class LostInProcesses(FakeNvml):
        def processes(self, index: int) -> list[GpuProcess]:
            if index == 1:
                raise NvmlError("nvmlDeviceGetComputeRunningProcesses", "GPU is lost", code=15)
            return super().processes(index)

    poller = _poller(LostInProcesses([FakeGpu(UUID_0), FakeGpu(UUID_1)]))
    poller.poll()
    snapshot = poller.snapshot()
    assert set(snapshot.readings) == set(snapshot.processes) == {0}


def test_gpu_poller_logs_nvml_stopping_again_after_it_recovered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, clock = _two_gpus(), Clock()
    poller = _poller(fake, clock)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        poller.poll()
        for _ in range(2):  # the same outage, with the same error text, twice
            fake.failing = True
            poller.poll()
            fake.failing = False
            clock.now += 60.0
            poller.poll()
            assert poller.nvml_up
    assert len(_warnings(caplog, "NVML stopped answering")) == 2


def test_gpu_poller_logs_a_failed_reinit_again_in_the_next_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, clock = _two_gpus(), Clock()
    poller = _poller(fake, clock)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        poller.poll()
        for _ in range(2):
            fake.failing = True
            poller.poll()
            clock.now += 60.0
            poller.poll()  # the re-init fails too
            fake.failing = False
            clock.now += 60.0
            poller.poll()
            assert poller.nvml_up
    assert len(_warnings(caplog, "no GPU telemetry: nvmlInit failed")) == 2


def test_gpu_poller_snapshot_carries_the_poll_duration_and_time() -> None:
    # The daemon's health collector exports them (tests/daemon/test_app.py).
    class Ticking:
        """A monotonic clock that moves 0.25 s each time it is read."""

        def __init__(self) -> None:
            self.now = 0.0

        def __call__(self) -> float:
            self.now += 0.25
            return self.now

    poller = GpuPoller(_two_gpus(), limiter=LogLimiter(), clock=Ticking(), wall_clock=lambda: 1.7e9)
    assert poller.snapshot().last_poll_unix is None
    poller.poll()
    assert poller.snapshot().last_poll_unix == 1.7e9
    assert poller.snapshot().poll_seconds > 0


def test_gpu_poller_records_the_poll_time_while_nvml_is_down() -> None:
    fake = FakeNvml(available=False)
    poller = GpuPoller(fake, limiter=LogLimiter(), clock=Clock(), wall_clock=lambda: 1.7e9)
    poller.poll()
    assert value(_scrape(poller), "stabmon_daemon_nvml_up") == 0
    assert poller.snapshot().last_poll_unix == 1.7e9
