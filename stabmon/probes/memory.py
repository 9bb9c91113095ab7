"""Device allocator figures and host RSS, sampled off the per-step path.

Every call here reads host-side bookkeeping: the CUDA caching allocator keeps
its statistics on the host, so ``memory_allocated`` and friends never wait for
the device; psutil reads ``/proc``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import psutil
import torch

__all__ = ["DeviceMemorySample", "HostMemory", "cuda_devices", "device_label", "sample_device"]


@dataclass(frozen=True)
class DeviceMemorySample:
    """Allocator figures of one CUDA device, in bytes."""

    allocated: int
    reserved: int
    peak_allocated: int


def cuda_devices(tensors: Iterable[torch.Tensor]) -> tuple[torch.device, ...]:
    """The distinct CUDA devices that ``tensors`` live on, in first-seen order."""
    seen: dict[torch.device, None] = {}
    for tensor in tensors:
        if tensor.device.type == "cuda":
            seen.setdefault(tensor.device, None)
    return tuple(seen)


def device_label(device: torch.device) -> str:
    """The ``device`` label value: ``cuda:0``, ``cpu``."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def sample_device(device: torch.device, *, reset_peak: bool = False) -> DeviceMemorySample:
    """Allocator figures of ``device``; ``reset_peak`` starts a new peak window (epoch)."""
    sample = DeviceMemorySample(
        allocated=torch.cuda.memory_allocated(device),
        reserved=torch.cuda.memory_reserved(device),
        peak_allocated=torch.cuda.max_memory_allocated(device),
    )
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return sample


class HostMemory:
    """Resident set size of one process (this one by default)."""

    def __init__(self, pid: int | None = None) -> None:
        self._process = psutil.Process(pid)

    def rss_bytes(self) -> int:
        return int(self._process.memory_info().rss)
