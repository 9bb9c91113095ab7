"""A programmable NVML for tests: the same ``NvmlReader`` interface as ``PynvmlReader``.

Each GPU holds NVML's raw units (percent, mW, MHz, a clock-event bitmask); readings
go through the same conversion helpers as the real reader, so the units tested
here are the units the daemon exports.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TypeVar

from stabmon.daemon.nvml import (
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
_UNINITIALIZED, _NOT_SUPPORTED, _LIBRARY_NOT_FOUND, _GPU_IS_LOST, _UNKNOWN = 1, 3, 12, 15, 999


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
    """Every call about this GPU raises NvmlError, as when it fell off the bus."""


class FakeNvml:
    """An ``NvmlReader`` whose GPUs, failures and XID events the test sets.

    ``available=False``: ``init`` raises NvmlUnavailable. ``failing=True``: every call
    raises NvmlError (NVML broke mid-run). ``calls`` lists every call made, by name.
    """

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        available: bool = True,
        xid_supported: bool = True,
    ) -> None:
        self.gpus = gpus if gpus is not None else []
        self.available = available
        self.failing = False
        self.xid_supported = xid_supported
        self.mig_parents: dict[str, str] = {}
        self.calls: list[str] = []
        self._initialised = False
        self._events_started = False
        self._events: deque[tuple[int, int]] = deque()
        self._event_arrived = threading.Condition()

    def push_xid(self, index: int, xid: int) -> None:
        """Queue an XID event for ``wait_xid`` to return."""
        with self._event_arrived:
            self._events.append((index, xid))
            self._event_arrived.notify_all()

    def init(self) -> None:
        self._check("nvmlInit", initialised=False)
        if not self.available:
            raise NvmlUnavailable(
                "nvmlInit", "NVML Shared Library Not Found", code=_LIBRARY_NOT_FOUND
            )
        self._initialised = True

    def shutdown(self) -> None:
        self._check("nvmlShutdown")
        self._initialised = False
        self._events_started = False

    def driver_version(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return "550.54.15"

    def devices(self) -> list[GpuIdentity]:
        self._check("nvmlDeviceGetCount")
        return [
            GpuIdentity(index, gpu.uuid, gpu.name, f"00000000:{index + 0x18:02X}:00.0")
            for index, gpu in enumerate(self.gpus)
        ]

    def reading(self, index: int) -> GpuReading:
        gpu = self._gpu("nvmlDeviceGetUtilizationRates", index)

        def supported(name: str, value: T) -> T | None:
            return None if name in gpu.unsupported else value

        return GpuReading(
            utilization_ratio=supported("utilization_ratio", to_ratio(gpu.utilization_percent)),
            memory_used_bytes=supported("memory_used_bytes", gpu.memory_used_bytes),
            memory_total_bytes=supported("memory_total_bytes", gpu.memory_total_bytes),
            temperature_celsius=supported("temperature_celsius", float(gpu.temperature_celsius)),
            power_watts=supported("power_watts", mw_to_watts(gpu.power_milliwatts)),
            sm_clock_hertz=supported("sm_clock_hertz", mhz_to_hertz(gpu.sm_clock_mhz)),
            throttle_reasons=supported(
                "throttle_reasons", throttle_reason_names(gpu.throttle_bitmask)
            ),
            ecc_corrected=supported("ecc_corrected", gpu.ecc_corrected),
            ecc_uncorrected=supported("ecc_uncorrected", gpu.ecc_uncorrected),
        )

    def processes(self, index: int) -> list[GpuProcess]:
        return list(self._gpu("nvmlDeviceGetComputeRunningProcesses", index).processes)

    def start_xid_events(self) -> None:
        self._check("nvmlEventSetCreate")
        if not self.xid_supported:
            raise NvmlError(
                "nvmlDeviceRegisterEvents",
                "no GPU on this node supports XID events",
                code=_NOT_SUPPORTED,
            )
        self._events_started = True

    def wait_xid(self, timeout_ms: int) -> list[tuple[int, int]]:
        self._check("nvmlEventSetWait")
        if not self._events_started:
            raise NvmlError("nvmlEventSetWait", "no event set: call start_xid_events() first")
        with self._event_arrived:
            self._event_arrived.wait_for(lambda: bool(self._events), timeout_ms / 1000.0)
            events = list(self._events)
            self._events.clear()
        return events

    def mig_parent_uuid(self, uuid: str) -> str | None:
        self._check("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        return self.mig_parents.get(uuid)

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
