"""Device allocator figures and host RSS, sampled off the per-step path.

The background sampler updates the "now" gauges every ``sample_seconds``;
the epoch-end sample feeds drift and leak detection and starts a new peak
window (``reset_peak_memory_stats`` is process-wide: documented in the README).

Every call here reads host-side bookkeeping: the CUDA caching allocator keeps
its statistics on the host, so ``memory_allocated`` and friends never wait for
the device; psutil reads ``/proc``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from stabmon.pipeline.readings import DeviceMemory, Readings

__all__ = [
    "DeviceMemorySample",
    "HostMemory",
    "MemorySampler",
    "cuda_devices",
    "device_label",
    "sample_device",
]


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

    def limit_bytes(self) -> float:
        """Memory this process may reach: its cgroup's limit, else RSS plus available memory."""
        limit = cgroup_memory_limit()
        if limit is not None:
            return float(limit)
        return float(self.rss_bytes() + psutil.virtual_memory().available)


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1 ``limit_in_bytes``)."""
    for candidate in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 says "no limit" with a huge number
            return int(text)
        return None  # "max": no limit
    return None


HOST = "host"
#: The device phase in which it waits for the next step's work (stabmon.probes.device_timing).
DATA_WAIT = "data_wait"


class MemorySampler:
    """Memory now (background thread) and at epoch end (training thread)."""

    def __init__(
        self,
        readings: Readings,
        host: HostMemory | None,
        devices: Callable[[], tuple[torch.device, ...]],
    ) -> None:
        self._readings = readings
        self._host = host
        self._devices = devices
        #: Device seconds the phase events spanned, and those of them not input wait, at the
        #: last sample that saw any: the next utilization is over the time between.
        self._device_seconds = (0.0, 0.0)
        #: The sampler thread and the training thread's epoch end both move it.
        self._utilization_lock = threading.Lock()

    def sample(self) -> None:
        """Host RSS, and each device's allocated, reserved and epoch-peak bytes; the first
        device's utilization over the interval since the last sample."""
        readings = self._readings
        if self._host is not None:
            readings.host_rss = self._host.rss_bytes()
        for index, device in enumerate(self._devices()):
            memory = sample_device(device)
            label = device_label(device)
            readings.device_memory[label] = DeviceMemory(memory.allocated, memory.reserved)
            readings.device_memory_peak[label] = memory.peak_allocated
            if index == 0:  # the device the phase events are recorded on
                self._utilization(label)

    def _utilization(self, label: str) -> None:
        """The share of the device's time this loop kept it working, from the phase events.

        Between two loop-boundary events the device either ran the loop's work (forward,
        backward, optimizer, named phases) or, from a step's end to the next forward's
        start (``data_wait``), had nothing queued: idle. Over the interval since the last
        sample that saw any device time: 1 - idle / all. No device time in the interval
        (no step completed on the device yet) leaves the last figure, so it never drops
        to 0 between two sparse samples. NVML's utilization (``torch.cuda.utilization``,
        the daemon's ``stabmon_gpu_utilization_ratio``) is a point read of the driver's
        last sample period, which flickered when read once per interval.
        """
        with self._utilization_lock:
            self._utilization_since_last(label)

    def _utilization_since_last(self, label: str) -> None:
        phases = self._readings.device_phase_seconds
        for _ in range(3):  # the training thread adds phases: a copy may meet a new key
            try:
                seconds = dict(phases)
                break
            except RuntimeError:
                continue
        else:
            return
        total = sum(seconds.values())
        busy = total - seconds.get(DATA_WAIT, 0.0)
        last_total, last_busy = self._device_seconds
        if total - last_total <= 0.0:
            return
        ratio = (busy - last_busy) / (total - last_total)
        self._readings.device_utilization[label] = min(1.0, max(0.0, ratio))
        self._device_seconds = (total, busy)

    def trend_samples(self) -> dict[str, float]:
        """Bytes now by label for the trend leak rule: RSS for host, allocated per device."""
        samples: dict[str, float] = {
            device_label(device): float(torch.cuda.memory_allocated(device))
            for device in self._devices()
        }
        if self._host is not None:
            samples[HOST] = float(self._host.rss_bytes())
        return samples

    def limits(self) -> dict[str, float]:
        """Bytes each label may reach: host as :meth:`HostMemory.limit_bytes`, CUDA device total."""
        limits: dict[str, float] = {
            device_label(device): float(torch.cuda.get_device_properties(device).total_memory)
            for device in self._devices()
        }
        if self._host is not None:
            limits[HOST] = self._host.limit_bytes()
        return limits

    def epoch_samples(self) -> tuple[dict[str, float], dict[str, float]]:
        """Epoch-end bytes by label (allocated per device, RSS for host) and the epoch peaks;
        starts the next epoch's peak window."""
        samples: dict[str, float] = {}
        peaks: dict[str, float] = {}
        for index, device in enumerate(self._devices()):
            label = device_label(device)
            memory = sample_device(device, reset_peak=True)
            samples[label] = memory.allocated
            peaks[label] = memory.peak_allocated
            if index == 0:  # an epoch's end is a sample too: the utilization up to it
                self._utilization(label)
        if self._host is not None:
            rss = self._host.rss_bytes()
            self._readings.host_rss = rss
            samples[HOST] = rss
        return samples, peaks
