"""Host-side readings of one training process: what the exporter publishes.

Design: the training thread (hooks, ``observe``, ``epoch_end``) and the
monitor's background threads write plain Python numbers here; the exporter's
collector reads them at scrape time. Nothing on the hot path takes a lock or
touches prometheus-client. Most fields have one writer; the memory gauges are
written by the sampler and at epoch end, and the anomaly counts by the training
thread and the watchdog, each a single store or ``+= 1`` under the GIL (a lost
increment would need two threads to judge an anomaly in the same instant).
Readers may see a value one update old, never a torn one. Counters only grow
within a process, so Prometheus sees them monotonic.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from stabmon.contract import ANOMALY_KINDS, PHASES

__all__ = ["DEFAULT_SECONDS_BUCKETS", "DeviceMemory", "GradReading", "Histogram", "Readings"]

#: Step and wait buckets from 1 ms to 10 min: fast CPU steps to slow large-model steps.
DEFAULT_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


class Histogram:
    """A cumulative-free bucket counter: one ``bisect`` and two adds per observation."""

    def __init__(self, bounds: Sequence[float] = DEFAULT_SECONDS_BUCKETS) -> None:
        self.bounds: tuple[float, ...] = tuple(bounds)
        # One slot per bound plus the +Inf overflow slot.
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative ``(upper_bound, count)`` pairs ending in ``+Inf``, and the sum."""
        counts = list(self._counts)  # one atomic copy; the writer may go on meanwhile
        cumulative: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*map(repr, self.bounds), "+Inf"), counts, strict=True):
            running += count
            cumulative.append((bound, float(running)))
        return cumulative, self._sum

    @property
    def count(self) -> int:
        return sum(self._counts)

    def totals(self) -> tuple[float, float]:
        """Observations so far and their sum: a mark to take means between."""
        return float(sum(self._counts)), self._sum


class GradReading(Protocol):
    """A measured step's gradients (:class:`stabmon.probes.grads.GradSummary`).

    The total and the zero count are plain numbers; the sums per module group and
    per placement are computed when read, so the training thread stores one
    reference per step and a scrape pays for the sums.
    """

    @property
    def total_norm(self) -> float: ...

    @property
    def zero_grad_params(self) -> int: ...

    @property
    def group_norms(self) -> dict[str, float]: ...

    @property
    def placement_squares(self) -> tuple[float, float]: ...


@dataclass
class DeviceMemory:
    """Allocator figures of one device, in bytes."""

    allocated: float
    reserved: float


@dataclass
class Readings:
    """Everything a training process exports, as plain numbers.

    ``None`` means "not measured yet": such gauges are left out of a scrape
    rather than exported as a misleading 0.
    """

    labels: dict[str, str]
    build_info: dict[str, str] = field(default_factory=dict)

    steps: int = 0
    epoch: int = 0
    last_step_unix: float | None = None
    step_duration: Histogram = field(default_factory=Histogram)
    data_wait: Histogram = field(default_factory=Histogram)
    #: Whether input wait is measured around the loop's fetches (track(), data_wait()); else
    #: it is all the time between a step's end and the next forward.
    input_wait_measured: bool = False
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    #: Label values of stabmon_device_info, one mapping per CUDA device (set at attach).
    device_info: list[dict[str, str]] = field(default_factory=list)
    #: The last measured gradients, replaced whole at each measured step (one store); the
    #: figures below are derived from it when read.
    grads: GradReading | None = None
    nonfinite_grad_steps: int = 0
    #: Measured steps whose clip scaled the gradients; the last step's clip coefficient.
    grad_clipped_steps: int = 0
    grad_clip_coefficient: float | None = None
    #: Seconds until memory runs out at the current trend, by device label (+inf: not growing).
    memory_exhaustion_seconds: dict[str, float] = field(default_factory=dict)
    nonfinite_losses: int = 0
    #: Dead parameters per module group (see stabmon.detectors.dead); empty before measuring.
    dead_grad_params: dict[str, int] = field(default_factory=dict)
    loss: float | None = None
    anomalies: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ANOMALY_KINDS, 0))

    amp_loss_scale: float | None = None
    amp_skipped_steps: int | None = None  # None: no scaler attached, so not exported

    device_memory: dict[str, DeviceMemory] = field(default_factory=dict)
    device_memory_peak: dict[str, float] = field(default_factory=dict)
    epoch_memory: dict[str, float] = field(default_factory=dict)
    memory_drift: dict[str, float] = field(default_factory=dict)
    memory_leak_suspected: dict[str, int] = field(default_factory=dict)
    host_rss: float | None = None
    stalled: int = 0

    # CUDA-event timing (stabmon/probes/device_timing.py); empty without CUDA.
    device_phase_seconds: dict[str, float] = field(default_factory=dict)
    device_utilization: dict[str, float] = field(default_factory=dict)
    device_step_duration: Histogram = field(default_factory=Histogram)

    # Throughput (stabmon/pipeline/throughput.py): counters from attach; MFU only with a CUDA peak.
    samples: int = 0
    tokens: int = 0
    #: FLOPs of one training step (None until known), counted for every step completed
    #: from ``flops_from_steps`` on: model_flops is derived at scrape, no work a step.
    flops_per_step: float | None = None
    flops_from_steps: int = 0
    peak_flops: float | None = None
    mfu: float | None = None
    slowdown_active: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    step_time_baseline: float | None = None

    @property
    def grad_norm(self) -> float | None:
        grads = self.grads
        return None if grads is None else grads.total_norm

    @property
    def zero_grad_params(self) -> int | None:
        grads = self.grads
        return None if grads is None else grads.zero_grad_params

    @property
    def module_grad_norms(self) -> dict[str, float]:
        """Norm per module group; empty before the first measurement."""
        grads = self.grads
        return {} if grads is None else grads.group_norms

    @property
    def grad_norm_squared(self) -> dict[str, float]:
        """Squared norms by placement ("replicated", "sharded"); empty before the first
        measurement."""
        grads = self.grads
        if grads is None:
            return {}
        replicated, sharded = grads.placement_squares
        return {"replicated": replicated, "sharded": sharded}

    def add_phase_time(self, phase: str, seconds: float) -> None:
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds

    def add_device_phase_time(self, phase: str, seconds: float) -> None:
        self.device_phase_seconds[phase] = self.device_phase_seconds.get(phase, 0.0) + seconds

    @property
    def model_flops(self) -> float | None:
        """Model FLOPs of the steps completed since the count was known (this process)."""
        per_step = self.flops_per_step
        return None if per_step is None else per_step * (self.steps - self.flops_from_steps)

    def count_anomaly(self, kind: str) -> None:
        self.anomalies[kind] = self.anomalies.get(kind, 0) + 1
