"""What the daemon knows about a GPU, in SI units and plain types: the readings, the reader
protocol, and the pure unit conversions the real reader and the test double share.

Nothing here imports pynvml (:mod:`stabmon.hardware.nvml` is the one seam that does), so
the daemon's collectors and the test double type against it freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from stabmon.hardware.nvml import NvmlError

__all__ = [
    "GpuIdentity",
    "GpuProcess",
    "GpuReading",
    "NvmlReader",
    "mhz_to_hertz",
    "mw_to_watts",
    "to_ratio",
]


@dataclass(frozen=True)
class GpuIdentity:
    """One physical GPU as NVML numbers it; ``uuid`` is NVML's own (``GPU-5f2c...``)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one poll, in SI units; ``None`` where the field is unsupported or failed."""

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
    errors: tuple[NvmlError, ...] = ()
    """Why fields that the GPU supports read ``None`` this time: one error per failed call."""


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
        """Release NVML (and the XID event set, if a wait does not hold it)."""
        ...

    def driver_version(self) -> str: ...

    def device_count(self) -> int:
        """How many GPUs NVML sees; they are numbered ``0 .. count - 1``."""
        ...

    def identity(self, index: int) -> GpuIdentity:
        """One GPU's identity; raises :class:`NvmlError` naming the call that failed."""
        ...

    def reading(self, index: int) -> GpuReading:
        """Raises :class:`NvmlError` only when the whole GPU fails; see :class:`GpuReading`."""
        ...

    def processes(self, index: int) -> list[GpuProcess]:
        """Compute and graphics processes on the GPU, one entry per pid."""
        ...

    def start_xid_events(self) -> None:
        """Register XID (critical error) events on every GPU that supports them.

        Raises :class:`NvmlError` when no GPU could be registered. While an event
        set exists, calling it again is a no-op: :meth:`reset_xid_events` first.
        """
        ...

    def reset_xid_events(self) -> None:
        """Free the event set (after a failed wait); never raises :class:`NvmlError`."""
        ...

    def wait_xid(self, timeout_ms: int) -> list[tuple[int, int]]:
        """Block up to ``timeout_ms`` for XID events: ``(gpu index, xid)`` pairs, [] on timeout."""
        ...

    def mig_parent_uuid(self, uuid: str) -> str | None:
        """For a ``MIG-...`` UUID, the parent GPU's UUID; None for other UUIDs or if unknown."""
        ...


# --- unit conversions (pure; the fake reader uses them too) ---------------------------------


def to_ratio(percent: float) -> float:
    """NVML percent (0..100) to a ratio (0..1)."""
    return percent / 100.0


def mw_to_watts(milliwatts: float) -> float:
    return milliwatts / 1000.0


def mhz_to_hertz(megahertz: float) -> float:
    return megahertz * 1e6
