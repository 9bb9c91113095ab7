"""The NVML seam: unit conversions, error wrapping, PynvmlReader's wiring, and the real reader.

PynvmlReader's own reads are tested on CPU against ``RawNvml``, which replaces
the pynvml functions it calls and answers in NVML's raw units.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml
import pytest
from helpers import has_nvidia_driver

from stabmon.contract import THROTTLE_REASONS
from stabmon.hardware.nvml import (
    THROTTLE_REASON_BITS,
    GpuIdentity,
    GpuProcess,
    NvmlError,
    NvmlUnavailable,
    PynvmlReader,
    mhz_to_hertz,
    mw_to_watts,
    throttle_reason_names,
    to_ratio,
)
from stabmon.hardware.nvml_constants import constants_of, nvml_constant

needs_no_driver = pytest.mark.skipif(has_nvidia_driver(), reason="Requires: no NVIDIA driver")


#: NVML's constants as the installed nvidia-ml-py spells them (nvml.h's value where it has
#: none): releases differ, and a test must not error on the GPU node's release.
NVML = constants_of(pynvml)
TEMPERATURE_GPU_MAX = nvml_constant(pynvml, "NVML_TEMPERATURE_GPU_MAX", default=1)
CLOCK_GRAPHICS = nvml_constant(pynvml, "NVML_CLOCK_GRAPHICS", default=0)
CLOCK_MEM = nvml_constant(pynvml, "NVML_CLOCK_MEM", default=2)
VOLATILE_ECC = nvml_constant(pynvml, "NVML_VOLATILE_ECC", default=0)
ERROR_UNKNOWN = nvml_constant(pynvml, "NVML_ERROR_UNKNOWN", default=999)
EVENT_PSTATE = nvml_constant(pynvml, "nvmlEventTypePState", default=0x10)


def test_to_ratio_turns_nvml_percent_into_a_ratio() -> None:
    assert to_ratio(57) == pytest.approx(0.57)
    assert to_ratio(100) == 1.0


def test_mw_to_watts_turns_nvml_milliwatts_into_watts() -> None:
    assert mw_to_watts(250_000) == 250.0


def test_mhz_to_hertz_turns_nvml_megahertz_into_hertz() -> None:
    assert mhz_to_hertz(1980) == pytest.approx(1.98e9)


def test_throttle_reason_names_names_thermal_and_power_bits() -> None:
    # NVML's documented bits: SwPowerCap 0x04, SwThermalSlowdown 0x20, HwThermalSlowdown 0x40.
    names = throttle_reason_names(0x04 | 0x20 | 0x40)
    assert names == {"sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown"}


def test_throttle_reason_names_ignores_unknown_bits() -> None:
    # 0x200 (board limit) and 0x400 (reliability) are newer NVML reasons the contract lacks.
    assert throttle_reason_names(0x200 | 0x400 | 1 << 40) == frozenset()
    assert throttle_reason_names(0x01 | 0x200) == {"gpu_idle"}


def test_throttle_reason_bits_cover_every_contract_reason_with_distinct_bits() -> None:
    assert set(THROTTLE_REASON_BITS) == set(THROTTLE_REASONS)
    bits = list(THROTTLE_REASON_BITS.values())
    assert all(bit and bit & (bit - 1) == 0 for bit in bits)  # one bit each
    assert len(set(bits)) == len(bits)


def test_nvml_error_names_the_call_and_carries_the_code() -> None:
    error = NvmlError("nvmlDeviceGetPowerUsage", "GPU is lost", code=15)
    assert str(error) == "nvmlDeviceGetPowerUsage failed: GPU is lost"
    assert (error.call, error.reason, error.code) == ("nvmlDeviceGetPowerUsage", "GPU is lost", 15)


@needs_no_driver
def test_pynvml_reader_init_raises_nvml_unavailable_without_a_driver() -> None:
    with pytest.raises(NvmlUnavailable, match=r"^nvmlInit failed: .*no NVIDIA driver"):
        PynvmlReader().init()


def test_pynvml_reader_wait_xid_raises_before_events_are_started() -> None:
    with pytest.raises(NvmlError, match="call start_xid_events"):
        PynvmlReader().wait_xid(10)


def test_pynvml_reader_mig_parent_uuid_reads_the_parent_from_a_legacy_mig_uuid() -> None:
    reader = PynvmlReader()
    assert reader.mig_parent_uuid("MIG-GPU-5f2c0a4e-1b2c-3d4e-5f60-718293a4b5c6/1/0") == (
        "GPU-5f2c0a4e-1b2c-3d4e-5f60-718293a4b5c6"
    )


def test_pynvml_reader_mig_parent_uuid_is_none_for_a_plain_gpu_uuid() -> None:
    assert PynvmlReader().mig_parent_uuid("GPU-5f2c0a4e-1b2c-3d4e-5f60-718293a4b5c6") is None


@needs_no_driver
def test_pynvml_reader_mig_parent_uuid_is_none_when_nvml_cannot_tell() -> None:
    assert PynvmlReader().mig_parent_uuid("MIG-8e2d7f15-5a1b-5c3d-9e4f-0a1b2c3d4e5f") is None


@pytest.mark.gpu
def test_pynvml_reader_reads_every_gpu_in_si_units() -> None:
    reader = PynvmlReader()
    reader.init()
    try:
        gpus = [reader.identity(index) for index in range(reader.device_count())]
        assert gpus, "NVML sees no GPU"
        assert reader.driver_version()
        for gpu in gpus:
            assert gpu.uuid.startswith("GPU-") and gpu.name and gpu.pci_bus_id
            reading = reader.reading(gpu.index)
            assert reading.utilization_ratio is None or 0.0 <= reading.utilization_ratio <= 1.0
            assert reading.memory_total_bytes is None or reading.memory_total_bytes > 2**30
            assert reading.power_watts is None or 1.0 < reading.power_watts < 2000.0
            assert reading.sm_clock_hertz is None or 1e7 < reading.sm_clock_hertz < 1e10
            assert reading.throttle_reasons is None or reading.throttle_reasons <= set(
                THROTTLE_REASONS
            )
            assert all(p.pid > 0 for p in reader.processes(gpu.index))
        reader.start_xid_events()
        assert reader.wait_xid(50) == []  # a healthy GPU: the wait times out
        reader.reset_xid_events()
        reader.start_xid_events()  # a fresh set after a reset
        assert reader.wait_xid(50) == []
    finally:
        reader.shutdown()


# --- PynvmlReader's own wiring, against pynvml functions replaced by RawNvml's -------------


@dataclass
class RawGpu:
    """One GPU as pynvml returns it: percent, mW, MHz, bitmasks, and bytes for text."""

    uuid: bytes = b"GPU-5f2c0a4e-1b2c-3d4e-5f60-718293a4b5c6"
    name: bytes = b"NVIDIA H100 80GB HBM3"
    bus_id: bytes = b"00000000:18:00.0"
    utilization: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(gpu=57, memory=12))
    memory: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(used=30 * 2**30, total=80 * 2**30, free=50 * 2**30)
    )
    temperatures: dict[int, int] = field(
        default_factory=lambda: {
            NVML.temperature_gpu: 71,
            TEMPERATURE_GPU_MAX: 90,
        }
    )
    power_milliwatts: int = 250_000
    clocks_mhz: dict[int, int] = field(
        default_factory=lambda: {
            CLOCK_GRAPHICS: 1755,
            NVML.clock_sm: 1980,
            CLOCK_MEM: 2619,
        }
    )
    event_reasons: int = 0x04 | 0x40  # SwPowerCap, HwThermalSlowdown
    ecc: dict[tuple[int, int], int] = field(
        default_factory=lambda: {
            (NVML.memory_error_corrected, NVML.aggregate_ecc): 7,
            (NVML.memory_error_corrected, VOLATILE_ECC): 2,
            (NVML.memory_error_uncorrected, NVML.aggregate_ecc): 1,
            (NVML.memory_error_uncorrected, VOLATILE_ECC): 0,
        }
    )
    compute: list[SimpleNamespace] = field(default_factory=list)
    graphics: list[SimpleNamespace] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    """pynvml function name -> the NVML error code it raises for this GPU."""


class RawNvml:
    """Stands in for the pynvml functions PynvmlReader calls; each method is named after one."""

    def __init__(self, gpus: list[RawGpu]) -> None:
        self.gpus = gpus
        self.calls: list[str] = []
        self.errors: dict[str, int] = {}  # pynvml function name -> NVML error code, any GPU
        self.events: list[SimpleNamespace] = []
        self.wait_released = threading.Event()
        self.wait_released.set()

    def _enter(self, call: str, gpu: RawGpu | None = None) -> None:
        self.calls.append(call)
        code = (gpu.errors if gpu is not None else {}).get(call, self.errors.get(call))
        if code is not None:
            raise pynvml.NVMLError(code)

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> bytes:
        self._enter("nvmlSystemGetDriverVersion")
        return b"550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> RawGpu:
        self._enter("nvmlDeviceGetHandleByIndex", self.gpus[index])
        return self.gpus[index]

    def nvmlDeviceGetIndex(self, handle: RawGpu) -> int:
        self._enter("nvmlDeviceGetIndex", handle)
        return self.gpus.index(handle)

    def nvmlDeviceGetUUID(self, handle: RawGpu) -> bytes:
        self._enter("nvmlDeviceGetUUID", handle)
        return handle.uuid

    def nvmlDeviceGetName(self, handle: RawGpu) -> bytes:
        self._enter("nvmlDeviceGetName", handle)
        return handle.name

    def nvmlDeviceGetPciInfo(self, handle: RawGpu) -> SimpleNamespace:
        self._enter("nvmlDeviceGetPciInfo", handle)
        return SimpleNamespace(busId=handle.bus_id)

    def nvmlDeviceGetUtilizationRates(self, handle: RawGpu) -> SimpleNamespace:
        self._enter("nvmlDeviceGetUtilizationRates", handle)
        return handle.utilization

    def nvmlDeviceGetMemoryInfo(self, handle: RawGpu) -> SimpleNamespace:
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        return handle.memory

    def nvmlDeviceGetTemperature(self, handle: RawGpu, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature", handle)
        return handle.temperatures[sensor]

    def nvmlDeviceGetPowerUsage(self, handle: RawGpu) -> int:
        self._enter("nvmlDeviceGetPowerUsage", handle)
        return handle.power_milliwatts

    def nvmlDeviceGetClockInfo(self, handle: RawGpu, clock: int) -> int:
        self._enter("nvmlDeviceGetClockInfo", handle)
        return handle.clocks_mhz[clock]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: RawGpu) -> int:
        self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle)
        return handle.event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: RawGpu) -> int:
        self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return handle.event_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: RawGpu, error_type: int, counter: int) -> int:
        self._enter("nvmlDeviceGetTotalEccErrors", handle)
        return handle.ecc[(error_type, counter)]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: RawGpu) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        return handle.compute

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: RawGpu) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetGraphicsRunningProcesses", handle)
        return handle.graphics

    def nvmlEventSetCreate(self) -> object:
        self._enter("nvmlEventSetCreate")
        return object()

    def nvmlEventSetFree(self, event_set: object) -> None:
        self._enter("nvmlEventSetFree")

    def nvmlDeviceRegisterEvents(self, handle: RawGpu, types: int, event_set: object) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        self._enter("nvmlEventSetWait_v2")
        self.wait_released.wait()
        if not self.events:
            raise pynvml.NVMLError(NVML.error_timeout)
        return self.events.pop(0)

    def push(self, index: int, xid: int, event_type: int = 0) -> None:
        event_type = event_type or NVML.event_xid_critical
        self.events.append(
            SimpleNamespace(eventType=event_type, eventData=xid, device=self.gpus[index])
        )


@pytest.fixture
def raw(monkeypatch: pytest.MonkeyPatch) -> RawNvml:
    """Two raw GPUs behind pynvml's functions, as PynvmlReader calls them."""
    nvml = RawNvml(
        [RawGpu(), RawGpu(uuid=b"GPU-8e2d7f15-5a1b-5c3d-9e4f-0a1b2c3d4e5f", bus_id=b"0:19:0.0")]
    )
    for name in dir(RawNvml):
        if name.startswith("nvml"):
            monkeypatch.setattr(pynvml, name, getattr(nvml, name))
    return nvml


def _process(pid: int, used: int | None) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, usedGpuMemory=used)


def test_pynvml_reader_reading_converts_raw_nvml_values_to_si_units(raw: RawNvml) -> None:
    reading = PynvmlReader().reading(0)
    assert reading.utilization_ratio == pytest.approx(0.57)  # .gpu, not .memory
    assert (reading.memory_used_bytes, reading.memory_total_bytes) == (30 * 2**30, 80 * 2**30)
    assert reading.temperature_celsius == 71.0  # the GPU sensor, not its slowdown limit
    assert reading.power_watts == 250.0
    assert reading.sm_clock_hertz == pytest.approx(1.98e9)  # the SM clock, not graphics
    assert reading.throttle_reasons == frozenset({"sw_power_cap", "hw_thermal_slowdown"})
    assert (reading.ecc_corrected, reading.ecc_uncorrected) == (7, 1)  # aggregate, not volatile
    assert reading.errors == ()


def test_pynvml_reader_reading_falls_back_to_the_throttle_reasons_call_on_old_drivers(
    raw: RawNvml,
) -> None:
    raw.errors["nvmlDeviceGetCurrentClocksEventReasons"] = NVML.error_function_not_found
    raw.gpus[0].event_reasons = 0x20
    reading = PynvmlReader().reading(0)
    assert reading.throttle_reasons == frozenset({"sw_thermal_slowdown"})
    assert reading.errors == ()


def test_pynvml_reader_reading_reads_unsupported_fields_as_none_without_errors(
    raw: RawNvml,
) -> None:
    raw.errors["nvmlDeviceGetPowerUsage"] = NVML.error_not_supported
    raw.errors["nvmlDeviceGetTotalEccErrors"] = NVML.error_not_supported
    reading = PynvmlReader().reading(0)
    assert (reading.power_watts, reading.ecc_corrected, reading.ecc_uncorrected) == (None,) * 3
    assert reading.temperature_celsius == 71.0
    assert reading.errors == ()


def test_pynvml_reader_reading_reads_a_failing_field_as_none_and_names_its_call(
    raw: RawNvml,
) -> None:
    raw.gpus[0].errors["nvmlDeviceGetPowerUsage"] = NVML.error_no_permission
    raw.gpus[0].errors["nvmlDeviceGetTemperature"] = ERROR_UNKNOWN
    reading = PynvmlReader().reading(0)
    assert (reading.power_watts, reading.temperature_celsius) == (None, None)
    assert reading.utilization_ratio == pytest.approx(0.57)
    assert reading.sm_clock_hertz == pytest.approx(1.98e9)
    assert [str(error) for error in reading.errors] == [
        "nvmlDeviceGetTemperature failed: Unknown Error",
        "nvmlDeviceGetPowerUsage failed: Insufficient Permissions",
    ]
    assert PynvmlReader().reading(1).power_watts == 250.0


def test_pynvml_reader_reading_raises_when_the_gpu_is_lost(raw: RawNvml) -> None:
    raw.gpus[0].errors["nvmlDeviceGetClockInfo"] = NVML.error_gpu_is_lost
    with pytest.raises(NvmlError, match=r"^nvmlDeviceGetClockInfo failed: GPU is lost$") as caught:
        PynvmlReader().reading(0)
    assert caught.value.gpu_lost


def test_pynvml_reader_processes_merges_both_lists_taking_the_larger_figure(
    raw: RawNvml,
) -> None:
    raw.gpus[0].compute = [_process(10, 2**30), _process(11, None)]
    raw.gpus[0].graphics = [_process(10, 2 * 2**30), _process(12, 2**29)]
    assert PynvmlReader().processes(0) == [
        GpuProcess(10, 2 * 2**30),  # in both lists: the larger figure, not the sum
        GpuProcess(11, None),
        GpuProcess(12, 2**29),
    ]


def test_pynvml_reader_processes_raises_naming_the_call_when_the_query_fails(
    raw: RawNvml,
) -> None:
    raw.errors["nvmlDeviceGetComputeRunningProcesses"] = NVML.error_no_permission
    with pytest.raises(NvmlError, match=r"^nvmlDeviceGetComputeRunningProcesses failed: Insuf"):
        PynvmlReader().processes(0)


def test_pynvml_reader_identity_reads_uuid_name_and_bus_id_as_text(raw: RawNvml) -> None:
    reader = PynvmlReader()
    assert reader.device_count() == 2
    assert reader.identity(0) == GpuIdentity(
        0, "GPU-5f2c0a4e-1b2c-3d4e-5f60-718293a4b5c6", "NVIDIA H100 80GB HBM3", "00000000:18:00.0"
    )
    assert reader.driver_version() == "550.54.15"


def test_pynvml_reader_identity_raises_naming_the_call_only_for_the_gpu_it_cannot_read(
    raw: RawNvml,
) -> None:
    raw.gpus[1].errors["nvmlDeviceGetUUID"] = NVML.error_gpu_is_lost
    reader = PynvmlReader()
    with pytest.raises(NvmlError, match=r"^nvmlDeviceGetUUID failed: GPU is lost$"):
        reader.identity(1)
    assert reader.identity(0).uuid == "GPU-5f2c0a4e-1b2c-3d4e-5f60-718293a4b5c6"


def test_pynvml_reader_init_raises_nvml_unavailable_when_the_library_is_missing(
    raw: RawNvml,
) -> None:
    raw.errors["nvmlInit"] = NVML.error_library_not_found
    with pytest.raises(NvmlUnavailable, match=r"^nvmlInit failed: .*no NVIDIA driver"):
        PynvmlReader().init()


def test_pynvml_reader_start_xid_events_is_a_no_op_until_reset(raw: RawNvml) -> None:
    reader = PynvmlReader()
    reader.start_xid_events()
    reader.start_xid_events()
    assert raw.calls.count("nvmlEventSetCreate") == 1
    reader.reset_xid_events()
    assert raw.calls.count("nvmlEventSetFree") == 1
    reader.start_xid_events()
    assert raw.calls.count("nvmlEventSetCreate") == 2


def test_pynvml_reader_reset_xid_events_forgets_a_set_nvml_cannot_free(raw: RawNvml) -> None:
    reader = PynvmlReader()
    reader.start_xid_events()
    raw.errors["nvmlEventSetFree"] = NVML.error_gpu_is_lost
    reader.reset_xid_events()
    with pytest.raises(NvmlError, match="call start_xid_events"):
        reader.wait_xid(10)


def test_pynvml_reader_wait_xid_drains_queued_xid_events_by_gpu_index(raw: RawNvml) -> None:
    reader = PynvmlReader()
    reader.start_xid_events()
    raw.push(0, 79)
    raw.push(1, 0, event_type=EVENT_PSTATE)  # not an XID: ignored
    raw.push(1, 48)
    assert reader.wait_xid(10) == [(0, 79), (1, 48)]
    assert reader.wait_xid(10) == []


def test_pynvml_reader_start_xid_events_registers_the_other_gpus_when_one_fails(
    raw: RawNvml, caplog: pytest.LogCaptureFixture
) -> None:
    raw.gpus[0].errors["nvmlDeviceRegisterEvents"] = NVML.error_gpu_is_lost
    reader = PynvmlReader()
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        reader.start_xid_events()
    raw.push(1, 79)
    assert reader.wait_xid(10) == [(1, 79)]
    assert [r.getMessage() for r in caplog.records] == [
        "stabmon daemon: XID errors on GPU 0 are not counted: "
        "nvmlDeviceRegisterEvents failed: GPU is lost"
    ]


def test_pynvml_reader_start_xid_events_raises_and_frees_the_set_when_no_gpu_supports_them(
    raw: RawNvml,
) -> None:
    raw.errors["nvmlDeviceRegisterEvents"] = NVML.error_not_supported
    with pytest.raises(NvmlError, match="no GPU on this node supports XID events"):
        PynvmlReader().start_xid_events()
    assert raw.calls.count("nvmlEventSetFree") == 1


def test_pynvml_reader_shutdown_shuts_nvml_down_even_when_freeing_the_event_set_fails(
    raw: RawNvml,
) -> None:
    reader = PynvmlReader()
    reader.start_xid_events()
    raw.errors["nvmlEventSetFree"] = ERROR_UNKNOWN
    reader.shutdown()
    assert raw.calls[-2:] == ["nvmlEventSetFree", "nvmlShutdown"]


def test_pynvml_reader_shutdown_does_not_wait_for_a_stuck_xid_wait(
    raw: RawNvml, caplog: pytest.LogCaptureFixture
) -> None:
    reader = PynvmlReader(lock_timeout=0.1)
    reader.start_xid_events()
    raw.wait_released.clear()  # the next wait blocks, holding the events lock
    waiter = threading.Thread(target=reader.wait_xid, args=(10,), daemon=True)
    waiter.start()
    while "nvmlEventSetWait_v2" not in raw.calls:
        time.sleep(0.01)
    release = threading.Timer(30.0, raw.wait_released.set)  # a reader that waits fails, not hangs
    release.start()
    try:
        with caplog.at_level(logging.WARNING, logger="stabmon"):
            reader.shutdown()
        returned_while_the_wait_was_stuck = not raw.wait_released.is_set()
    finally:
        release.cancel()
        raw.wait_released.set()
        waiter.join(timeout=1.0)
    assert returned_while_the_wait_was_stuck
    assert "nvmlShutdown" in raw.calls
    assert "nvmlEventSetFree" not in raw.calls
    assert [r.getMessage() for r in caplog.records] == [
        "stabmon daemon: NVML shut down without freeing the XID event set: an XID wait "
        "still held it after 0.1 s"
    ]
