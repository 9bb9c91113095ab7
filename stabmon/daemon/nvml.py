"""The NVML seam: the only module in stabmon that imports ``pynvml``.

Everything the daemon knows about GPUs comes through :class:`NvmlReader`, in
SI units and plain Python types: NVML's percent, milliwatts, megahertz and
clock-event bitmasks stop here, converted by the pure helpers below
(:func:`to_ratio`, :func:`mw_to_watts`, :func:`mhz_to_hertz`,
:func:`throttle_reason_names`) that the test double in
``tests/daemon/fake_nvml.py`` uses too.

Errors: a field the GPU does not support is ``None`` in the reading; any other
NVML failure raises :class:`NvmlError`, which names the NVML call, and a node
without a driver raises :class:`NvmlUnavailable` from :meth:`NvmlReader.init`.

Design
------
:class:`PynvmlReader` keeps no device handles: it asks NVML for the handle by
index on every call (NVML caches them), so a re-init never leaves a stale one.
Its only state is the XID event set, which the XID thread waits on while the
poll thread may shut NVML down; a lock makes ``shutdown`` wait for the current
wait to return (at most its timeout) instead of freeing the set under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import pynvml

from stabmon.contract import THROTTLE_REASONS

__all__ = [
    "GpuIdentity",
    "GpuProcess",
    "GpuReading",
    "NvmlError",
    "NvmlReader",
    "NvmlUnavailable",
    "PynvmlReader",
    "THROTTLE_REASON_BITS",
    "mhz_to_hertz",
    "mw_to_watts",
    "throttle_reason_names",
    "to_ratio",
]


class NvmlError(Exception):
    """An NVML call failed; ``call`` names it and ``code`` is NVML's error code when known."""

    def __init__(self, call: str, reason: str, *, code: int | None = None) -> None:
        self.call = call
        self.reason = reason
        self.code = code
        super().__init__(f"{call} failed: {reason}")


class NvmlUnavailable(NvmlError):
    """No NVIDIA driver / library: the daemon runs without GPU telemetry."""


# --- typed readings -------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuIdentity:
    """One physical GPU as NVML numbers it; ``uuid`` is NVML's own (``GPU-5f2c...``)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one poll, in SI units; ``None`` where the GPU does not support the field."""

    utilization_ratio: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    temperature_celsius: float | None
    power_watts: float | None
    sm_clock_hertz: float | None
    throttle_reasons: frozenset[str] | None
    """Active clock event reasons, as :data:`~stabmon.contract.THROTTLE_REASONS` names."""
    ecc_corrected: int | None
    """Lifetime (aggregate) count, so it only grows; ``None`` without ECC."""
    ecc_uncorrected: int | None


@dataclass(frozen=True)
class GpuProcess:
    """A process with a compute or graphics context on a GPU; ``used_bytes`` may be unknown."""

    pid: int
    used_bytes: int | None


class NvmlReader(Protocol):
    """What the daemon needs from NVML. ``PynvmlReader`` is the real one."""

    def init(self) -> None:
        """Initialise NVML; raises :class:`NvmlUnavailable` without a driver."""
        ...

    def shutdown(self) -> None:
        """Release NVML (and the XID event set)."""
        ...

    def driver_version(self) -> str: ...

    def devices(self) -> list[GpuIdentity]:
        """Every GPU NVML sees, by index."""
        ...

    def reading(self, index: int) -> GpuReading:
        """Raises :class:`NvmlError` when the whole GPU fails; an unsupported field is None."""
        ...

    def processes(self, index: int) -> list[GpuProcess]:
        """Compute and graphics processes on the GPU, one entry per pid."""
        ...

    def start_xid_events(self) -> None:
        """Register XID (critical error) events on every GPU that supports them.

        Raises :class:`NvmlError` when no GPU does. Calling it again is a no-op.
        """
        ...

    def wait_xid(self, timeout_ms: int) -> list[tuple[int, int]]:
        """Block up to ``timeout_ms`` for XID events: ``(gpu index, xid)`` pairs, [] on timeout."""
        ...

    def mig_parent_uuid(self, uuid: str) -> str | None:
        """For a ``MIG-...`` UUID, the parent GPU's UUID; None for other UUIDs or if unknown."""
        ...


# --- unit conversions (pure; the fake reader uses them too) ---------------------------------

#: NVML's clock event reason bits, by contract reason name.
THROTTLE_REASON_BITS: Mapping[str, int] = MappingProxyType(
    {
        "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
        "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
        "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
        "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
        "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
        "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
        "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
        "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
    }
)
if set(THROTTLE_REASON_BITS) != set(THROTTLE_REASONS):  # not assert: it must survive python -O
    raise RuntimeError("THROTTLE_REASON_BITS and contract.THROTTLE_REASONS disagree")


def to_ratio(percent: float) -> float:
    """NVML percent (0..100) to a ratio (0..1)."""
    return percent / 100.0


def mw_to_watts(milliwatts: float) -> float:
    return milliwatts / 1000.0


def mhz_to_hertz(megahertz: float) -> float:
    return megahertz * 1e6


def throttle_reason_names(bitmask: int) -> frozenset[str]:
    """Contract names of the reasons set in an NVML clock event bitmask; unknown bits ignored."""
    return frozenset(name for name, bit in THROTTLE_REASON_BITS.items() if bitmask & bit)


# --- the real reader ------------------------------------------------------------------------

# A driver too old for a call reports FUNCTION_NOT_FOUND: to us, that field is unsupported too.
_UNSUPPORTED = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
_NO_DRIVER = frozenset({pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED})
_MAX_EVENTS_PER_WAIT = 64


def _call(function: Callable[..., Any], *args: Any) -> Any:
    """Call a pynvml function, turning its errors into :class:`NvmlError` named after the call."""
    try:
        return function(*args)
    except pynvml.NVMLError as error:
        raise NvmlError(function.__name__, str(error), code=error.value) from error
    except pynvml.NVMLLibraryMismatchError as error:  # an unversioned call the driver lacks
        code = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
        raise NvmlError(function.__name__, str(error), code=code) from error


def _optional(function: Callable[..., Any], *args: Any) -> Any:
    """Like :func:`_call`, but None when the GPU does not support the call."""
    try:
        return _call(function, *args)
    except NvmlError as error:
        if error.code in _UNSUPPORTED:
            return None
        raise


def _text(value: object) -> str:
    """Older pynvml releases return bytes where newer ones return str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _map(value: Any, convert: Callable[[Any], Any]) -> Any:
    return None if value is None else convert(value)


class PynvmlReader:
    """:class:`NvmlReader` over the real NVML library.

    Example::

        reader = PynvmlReader()
        reader.init()  # NvmlUnavailable on a node without an NVIDIA driver
        for gpu in reader.devices():
            print(gpu.uuid, reader.reading(gpu.index).power_watts)
        reader.shutdown()
    """

    def __init__(self) -> None:
        self._events_lock = threading.Lock()
        self._event_set: Any = None

    def init(self) -> None:
        try:
            _call(pynvml.nvmlInit)
        except NvmlError as error:
            if error.code in _NO_DRIVER:
                raise NvmlUnavailable(
                    error.call,
                    f"{error.reason} (no NVIDIA driver on this node: no GPU telemetry)",
                    code=error.code,
                ) from error
            raise

    def shutdown(self) -> None:
        with self._events_lock:
            event_set, self._event_set = self._event_set, None
            if event_set is not None:
                _optional(pynvml.nvmlEventSetFree, event_set)
        _call(pynvml.nvmlShutdown)

    def driver_version(self) -> str:
        return _text(_call(pynvml.nvmlSystemGetDriverVersion))

    def devices(self) -> list[GpuIdentity]:
        identities = []
        for index in range(int(_call(pynvml.nvmlDeviceGetCount))):
            handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
            identities.append(
                GpuIdentity(
                    index=index,
                    uuid=_text(_call(pynvml.nvmlDeviceGetUUID, handle)),
                    name=_text(_call(pynvml.nvmlDeviceGetName, handle)),
                    pci_bus_id=_text(_call(pynvml.nvmlDeviceGetPciInfo, handle).busId),
                )
            )
        return identities

    def reading(self, index: int) -> GpuReading:
        handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
        utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
        memory = _optional(pynvml.nvmlDeviceGetMemoryInfo, handle)
        temperature = _optional(
            pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
        )
        power = _optional(pynvml.nvmlDeviceGetPowerUsage, handle)
        clock = _optional(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
        reasons = _optional(pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
        if reasons is None:  # drivers before 535 know only the older name
            reasons = _optional(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        return GpuReading(
            utilization_ratio=_map(utilization, lambda u: to_ratio(u.gpu)),
            memory_used_bytes=_map(memory, lambda m: int(m.used)),
            memory_total_bytes=_map(memory, lambda m: int(m.total)),
            temperature_celsius=_map(temperature, float),
            power_watts=_map(power, mw_to_watts),
            sm_clock_hertz=_map(clock, mhz_to_hertz),
            throttle_reasons=_map(reasons, throttle_reason_names),
            ecc_corrected=self._ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ecc_uncorrected=self._ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        )

    def processes(self, index: int) -> list[GpuProcess]:
        handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
        used_by_pid: dict[int, int | None] = {}
        for query in (
            pynvml.nvmlDeviceGetComputeRunningProcesses,
            pynvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            for process in _optional(query, handle) or []:
                pid = int(process.pid)
                used = _map(process.usedGpuMemory, int)  # None where the OS hides it (WDDM)
                known = [b for b in (used_by_pid.get(pid), used) if b is not None]
                # One process in both lists: take the larger figure rather than count twice.
                used_by_pid[pid] = max(known) if known else None
        return [GpuProcess(pid, used) for pid, used in used_by_pid.items()]

    def start_xid_events(self) -> None:
        with self._events_lock:
            if self._event_set is not None:
                return
            event_set = _call(pynvml.nvmlEventSetCreate)
            registered = 0
            try:
                for index in range(int(_call(pynvml.nvmlDeviceGetCount))):
                    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
                    xid = pynvml.nvmlEventTypeXidCriticalError
                    try:
                        _call(pynvml.nvmlDeviceRegisterEvents, handle, xid, event_set)
                    except NvmlError as error:
                        if error.code not in _UNSUPPORTED:
                            raise
                        continue  # e.g. a GPU in a VM without event support: skip it
                    registered += 1
                if registered == 0:
                    raise NvmlError(
                        "nvmlDeviceRegisterEvents",
                        "no GPU on this node supports XID events",
                        code=pynvml.NVML_ERROR_NOT_SUPPORTED,
                    )
            except NvmlError:
                _optional(pynvml.nvmlEventSetFree, event_set)
                raise
            self._event_set = event_set

    def wait_xid(self, timeout_ms: int) -> list[tuple[int, int]]:
        events: list[tuple[int, int]] = []
        with self._events_lock:
            if self._event_set is None:
                raise NvmlError("nvmlEventSetWait", "no event set: call start_xid_events() first")
            while len(events) < _MAX_EVENTS_PER_WAIT:
                try:
                    data = _call(pynvml.nvmlEventSetWait_v2, self._event_set, timeout_ms)
                except NvmlError as error:
                    if error.code == pynvml.NVML_ERROR_TIMEOUT:
                        return events
                    raise
                if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                    events.append((self._event_index(data.device), int(data.eventData)))
                timeout_ms = 0  # drain what else is queued, without waiting again
        return events

    def mig_parent_uuid(self, uuid: str) -> str | None:
        if not uuid.startswith("MIG-"):
            return None
        if uuid.startswith("MIG-GPU-"):  # the pre-R470 form names its parent: MIG-GPU-<uuid>/gi/ci
            return uuid[len("MIG-") :].split("/", 1)[0]
        try:
            mig = _call(pynvml.nvmlDeviceGetHandleByUUID, uuid)
            parent = _call(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, mig)
            return _text(_call(pynvml.nvmlDeviceGetUUID, parent))
        except NvmlError:
            return None

    @staticmethod
    def _ecc(handle: Any, error_type: int) -> int | None:
        count = _optional(
            pynvml.nvmlDeviceGetTotalEccErrors, handle, error_type, pynvml.NVML_AGGREGATE_ECC
        )
        return None if count is None else int(count)

    @staticmethod
    def _event_index(device: Any) -> int:
        try:
            return int(_call(pynvml.nvmlDeviceGetIndex, device))
        except NvmlError:
            return -1  # count the XID under an unknown GPU rather than lose it
