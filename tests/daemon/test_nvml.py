"""The NVML seam: unit conversions, error wrapping, and the real reader on this machine."""

from __future__ import annotations

import ctypes

import pytest

from stabmon.contract import THROTTLE_REASONS
from stabmon.daemon.nvml import (
    THROTTLE_REASON_BITS,
    NvmlError,
    NvmlUnavailable,
    PynvmlReader,
    mhz_to_hertz,
    mw_to_watts,
    throttle_reason_names,
    to_ratio,
)


def _has_nvidia_driver() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


needs_no_driver = pytest.mark.skipif(_has_nvidia_driver(), reason="Requires: no NVIDIA driver")


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
        gpus = reader.devices()
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
    finally:
        reader.shutdown()
