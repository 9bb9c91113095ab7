"""A programmable NVML for tests: the same ``NvmlReader`` interface as ``PynvmlReader``.

Each GPU holds NVML's raw units (percent, mW, MHz, a clock-event bitmask); readings
go through the same conversion helpers as the real reader, so the units tested
here are the units the daemon exports. Failures come in the real reader's shapes:
a field that fails reads None and is listed in ``GpuReading.errors``, a lost GPU
raises, and a failed XID wait leaves the event set broken until it is reset.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TypeVar

from stabmon.hardware.nvml import (
    GpuIdentity,
    GpuProcess,
    GpuReading,
    NvmlError,
    NvmlUnavailable,
    mhz_to_hertz,
    mw_to_watts,
    throttle_reason_names,
    to_ratio,
)

T = TypeVar("T")

# NVML's error codes, for messages that read like the real ones.
_UNINITIALIZED, _NOT_SUPPORTED, _NO_PERMISSION = 1, 3, 4
_LIBRARY_NOT_FOUND, _GPU_IS_LOST, _UNKNOWN = 12, 15, 999

#: ``FakeNvml.fail_calls`` names: each fails the NVML call named here (and the fields it reads).
CALLS: dict[str, str] = {
    "identity": "nvmlDeviceGetUUID",
    "utilization": "nvmlDeviceGetUtilizationRates",
    "memory": "nvmlDeviceGetMemoryInfo",
    "temperature": "nvmlDeviceGetTemperature",
    "power": "nvmlDeviceGetPowerUsage",
    "sm_clock": "nvmlDeviceGetClockInfo",
    "throttle": "nvmlDeviceGetCurrentClocksEventReasons",
    "ecc": "nvmlDeviceGetTotalEccErrors",
    "processes": "nvmlDeviceGetComputeRunningProcesses",
}


@dataclass
class FakeGpu:
    """One GPU in NVML's raw units; ``unsupported`` names ``GpuReading`` fields that read None."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    utilization_percent: int = 0
    memory_used_bytes: int = 0
    memory_total_bytes: int = 80 * 2**30
    temperature_celsius: int = 35
    power_milliwatts: int = 70_000
    sm_clock_mhz: int = 345
    throttle_bitmask: int = 0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    processes: list[GpuProcess] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    fails: bool = False
    """Its readings and process queries raise GPU_IS_LOST, as when it fell off the bus."""


class FakeNvml:
    """An ``NvmlReader`` whose GPUs, failures and XID events the test sets.

    ``available=False``: ``init`` raises NvmlUnavailable. ``failing=True``: every call
    raises NvmlError (NVML broke mid-run). ``fail_calls``: {gpu index: names from
    :data:`CALLS`} whose NVML call fails with NO_PERMISSION, each on its own.
    ``calls`` lists every call made, by name.
    """

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        available: bool = True,
        xid_supported: bool = True,
        fail_calls: dict[int, set[str]] | None = None,
    ) -> None:
        self.gpus = gpus if gpus is not None else []
        self.available = available
        self.failing = False
        self.xid_supported = xid_supported
        self.fail_calls: dict[int, set[str]] = fail_calls if fail_calls is not None else {}
        self.mig_parents: dict[str, str] = {}
        self.calls: list[str] = []
        self._initialised = False
        self._event_set: str | None = None  # None, "ok", or "broken" after a failed wait
        self._events: deque[tuple[int, int]] = deque()
        self._event_arrived = threading.Condition()

    def push_xid(self, index: int, xid: int) -> None:
        """Queue an XID event for ``wait_xid`` to return."""
        with self._event_arrived:
            self._events.append((index, xid))
            self._event_arrived.notify_all()

    def break_xid_events(self) -> None:
        """Break the event set, as a GPU lost under a wait does: waits fail until a reset."""
        with self._event_arrived:
            if self._event_set is not None:
                self._event_set = "broken"
            self._event_arrived.notify_all()

    def init(self) -> None:
        self._check("nvmlInit", initialised=False)
        if not self.available:
            raise NvmlUnavailable(
                "nvmlInit", "NVML Shared Library Not Found", code=_LIBRARY_NOT_FOUND
            )
        self._initialised = True

    def shutdown(self) -> None:
        self.reset_xid_events()
        self._check("nvmlShutdown")
        self._initialised = False

    def driver_version(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return "550.54.15"

    def device_count(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def identity(self, index: int) -> GpuIdentity:
        self._check("nvmlDeviceGetHandleByIndex")
        gpu = self.gpus[index]
        failure = self._failure(index, "identity")
        if failure is not None:
            raise failure
        return GpuIdentity(index, gpu.uuid, gpu.name, f"00000000:{index + 0x18:02X}:00.0")

    def reading(self, index: int) -> GpuReading:
        gpu = self._gpu("nvmlDeviceGetUtilizationRates", index)
        errors: dict[str, NvmlError] = {}  # one per failed call, as the real reader reports

        def read(call: str, field_name: str, value: T) -> T | None:
            failure = self._failure(index, call)
            if failure is not None:
                errors.setdefault(call, failure)
                return None
            return None if field_name in gpu.unsupported else value

        utilization = to_ratio(gpu.utilization_percent)
        throttle = throttle_reason_names(gpu.throttle_bitmask)
        reading = GpuReading(
            utilization_ratio=read("utilization", "utilization_ratio", utilization),
            memory_used_bytes=read("memory", "memory_used_bytes", gpu.memory_used_bytes),
            memory_total_bytes=read("memory", "memory_total_bytes", gpu.memory_total_bytes),
            temperature_celsius=read(
                "temperature", "temperature_celsius", float(gpu.temperature_celsius)
            ),
            power_watts=read("power", "power_watts", mw_to_watts(gpu.power_milliwatts)),
            sm_clock_hertz=read("sm_clock", "sm_clock_hertz", mhz_to_hertz(gpu.sm_clock_mhz)),
            throttle_reasons=read("throttle", "throttle_reasons", throttle),
            ecc_corrected=read("ecc", "ecc_corrected", gpu.ecc_corrected),
            ecc_uncorrected=read("ecc", "ecc_uncorrected", gpu.ecc_uncorrected),
        )
        return dataclasses.replace(reading, errors=tuple(errors.values()))

    def processes(self, index: int) -> list[GpuProcess]:
        gpu = self._gpu("nvmlDeviceGetComputeRunningProcesses", index)
        failure = self._failure(index, "processes")
        if failure is not None:
            raise failure
        return list(gpu.processes)

    def start_xid_events(self) -> None:
        # Under the lock: a test that breaks the set once it sees the create call must
        # find the set made, not race this method between the call and the assignment.
        with self._event_arrived:
            if self._event_set is not None:
                return  # like the real reader: a no-op while a set exists, broken or not
            self._check("nvmlEventSetCreate")
            if not self.xid_supported:
                raise NvmlError(
                    "nvmlDeviceRegisterEvents",
                    "no GPU on this node supports XID events",
                    code=_NOT_SUPPORTED,
                )
            self._event_set = "ok"

    def reset_xid_events(self) -> None:
        with self._event_arrived:
            if self._event_set is not None:
                self.calls.append("nvmlEventSetFree")
            self._event_set = None
            self._event_arrived.notify_all()

    def wait_xid(self, timeout_ms: int) -> list[tuple[int, int]]:
        with self._event_arrived:
            try:
                self._check("nvmlEventSetWait")
            except NvmlError:
                if self._event_set is not None:
                    self._event_set = "broken"
                raise
            self._raise_unless_event_set_ok()
            self._event_arrived.wait_for(
                lambda: bool(self._events) or self._event_set != "ok", timeout_ms / 1000.0
            )
            self._raise_unless_event_set_ok()
            events = list(self._events)
            self._events.clear()
        return events

    def mig_parent_uuid(self, uuid: str) -> str | None:
        self._check("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        return self.mig_parents.get(uuid)

    def _raise_unless_event_set_ok(self) -> None:
        if self._event_set is None:
            raise NvmlError("nvmlEventSetWait", "no event set: call start_xid_events() first")
        if self._event_set == "broken":
            raise NvmlError("nvmlEventSetWait", "GPU is lost", code=_GPU_IS_LOST)

    def _check(self, call: str, *, initialised: bool = True) -> None:
        self.calls.append(call)
        if self.failing:
            raise NvmlError(call, "Unknown Error", code=_UNKNOWN)
        if initialised and not self._initialised:
            raise NvmlError(call, "Uninitialized", code=_UNINITIALIZED)

    def _gpu(self, call: str, index: int) -> FakeGpu:
        self._check(call)
        gpu = self.gpus[index]
        if gpu.fails:
            raise NvmlError(call, "GPU is lost", code=_GPU_IS_LOST)
        return gpu

    def _failure(self, index: int, name: str) -> NvmlError | None:
        """The error for ``name`` on GPU ``index`` if the test made it fail, else None."""
        failing = self.fail_calls.get(index, set())
        if unknown := failing - set(CALLS):
            raise ValueError(f"fail_calls[{index}]: unknown call names {sorted(unknown)}")
        if name not in failing:
            return None
        return NvmlError(CALLS[name], "Insufficient Permissions", code=_NO_PERMISSION)
