"""The NVML constants the daemon uses, read defensively from whatever ``pynvml`` a node has.

nvidia-ml-py adds and renames constants between releases (the clock *throttle* reasons
became clock *event* reasons in 12.535; ``NVML_TEMPERATURE_GPU_MAX`` exists in some
releases only), while the values are NVML's C ABI (``nvml.h``) and never change. So each
constant is looked up by its names, newest first, and falls back to the value from
``nvml.h``: the daemon runs against any nvidia-ml-py, old or new, and never fails at import
for a name its release lacks. The module is handed in (:func:`constants_of`), so this
file imports no ``pynvml`` and a test can hand it a stand-in.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NvmlConstants", "constants_of", "nvml_constant"]


def nvml_constant(module: object, *names: str, default: int) -> int:
    """The first of ``names`` that ``module`` defines as an int, else ``default`` (nvml.h's)."""
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def _reason(module: object, name: str, default: int) -> int:
    """A clock event reason bit: ``nvmlClocksEventReason<name>``, formerly ``...Throttle...``."""
    return nvml_constant(
        module, f"nvmlClocksEventReason{name}", f"nvmlClocksThrottleReason{name}", default=default
    )


@dataclass(frozen=True)
class NvmlConstants:
    """NVML's error codes, enums and bits, as one pynvml release spells them."""

    error_not_supported: int = 3
    error_no_permission: int = 4
    error_driver_not_loaded: int = 9
    error_timeout: int = 10
    error_library_not_found: int = 12
    error_function_not_found: int = 13
    error_gpu_is_lost: int = 15
    temperature_gpu: int = 0
    clock_sm: int = 1
    memory_error_corrected: int = 0
    memory_error_uncorrected: int = 1
    aggregate_ecc: int = 1
    event_xid_critical: int = 0x8
    #: Clock event reason bits by contract reason name (stabmon.contract.THROTTLE_REASONS).
    reasons: tuple[tuple[str, int], ...] = ()


#: (field, pynvml name) for every plain constant; the defaults are the fields' own.
_NAMES = (
    ("error_not_supported", "NVML_ERROR_NOT_SUPPORTED"),
    ("error_no_permission", "NVML_ERROR_NO_PERMISSION"),
    ("error_driver_not_loaded", "NVML_ERROR_DRIVER_NOT_LOADED"),
    ("error_timeout", "NVML_ERROR_TIMEOUT"),
    ("error_library_not_found", "NVML_ERROR_LIBRARY_NOT_FOUND"),
    ("error_function_not_found", "NVML_ERROR_FUNCTION_NOT_FOUND"),
    ("error_gpu_is_lost", "NVML_ERROR_GPU_IS_LOST"),
    ("temperature_gpu", "NVML_TEMPERATURE_GPU"),
    ("clock_sm", "NVML_CLOCK_SM"),
    ("memory_error_corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
    ("memory_error_uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"),
    ("aggregate_ecc", "NVML_AGGREGATE_ECC"),
    ("event_xid_critical", "nvmlEventTypeXidCriticalError"),
)

#: (contract name, NVML name, nvml.h bit) of each clock event reason.
_REASONS = (
    ("gpu_idle", "GpuIdle", 0x1),
    ("applications_clocks_setting", "ApplicationsClocksSetting", 0x2),
    ("sw_power_cap", "SwPowerCap", 0x4),
    ("hw_slowdown", "HwSlowdown", 0x8),
    ("sync_boost", "SyncBoost", 0x10),
    ("sw_thermal_slowdown", "SwThermalSlowdown", 0x20),
    ("hw_thermal_slowdown", "HwThermalSlowdown", 0x40),
    ("hw_power_brake_slowdown", "HwPowerBrakeSlowdown", 0x80),
    ("display_clock_setting", "DisplayClockSetting", 0x100),
)


def constants_of(module: object) -> NvmlConstants:
    """The constants ``module`` (pynvml) defines, nvml.h's value for each it lacks."""
    defaults = NvmlConstants()
    values = {
        field: nvml_constant(module, name, default=getattr(defaults, field))
        for field, name in _NAMES
    }
    reasons = tuple((contract, _reason(module, name, bit)) for contract, name, bit in _REASONS)
    return NvmlConstants(**values, reasons=reasons)
