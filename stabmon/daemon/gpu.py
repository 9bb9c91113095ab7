"""The daemon's GPU telemetry: a poller caches NVML readings, a collector reads the cache.

Design
------
Only the daemon's NVML poll thread calls :meth:`GpuPoller.poll`, and a poll is
the only place NVML is read for metrics (the XID thread waits on its own event
set, see :mod:`stabmon.daemon.xid_events`). Each poll builds a new immutable
:class:`GpuSnapshot` and swaps it in with one assignment, atomic in CPython, so
the scrape thread's :class:`GpuCollector` reads a consistent snapshot without a
lock and returns in milliseconds whatever NVML is doing.

NVML is either down (never initialised, no driver, or it stopped answering:
``stabmon_daemon_nvml_up`` 0, no GPU series, init retried at most every 60 s)
or up. While it is up, failures stay as small as they are: a GPU whose identity
cannot be read at init is left out (and retried every 60 s), a field that fails
is left out of that GPU's series, a failed process query leaves that GPU with
no processes, and only a GPU that is gone is left out of the poll. Each problem
is logged once per NVML session: a new outage after a recovery is logged again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from stabmon.contract import (
    DAEMON_NVML_UP,
    GPU_ECC_ERRORS,
    GPU_MEMORY_TOTAL,
    GPU_MEMORY_USED,
    GPU_POWER,
    GPU_SM_CLOCK,
    GPU_TEMPERATURE,
    GPU_THROTTLE_ACTIVE,
    GPU_UTILIZATION,
    GPU_XID_ERRORS,
    THROTTLE_REASONS,
    MetricDef,
)
from stabmon.export.families import family
from stabmon.hardware.nvml import (
    GpuIdentity,
    GpuProcess,
    GpuReading,
    NvmlError,
    NvmlReader,
    NvmlUnavailable,
)
from stabmon.shared.log import LogLimiter

__all__ = ["GpuCollector", "GpuPoller", "GpuSnapshot"]

#: A failed init is retried at most this often: a driverless node must not pay for it every poll.
_INIT_RETRY_SECONDS = 60.0
#: The ``poller`` label of this poller's health series.


@dataclass(frozen=True)
class GpuSnapshot:
    """What the last poll saw; readings and processes are keyed by GPU index.

    A GPU in ``identities`` but not in ``readings`` failed that poll.
    """

    nvml_up: bool
    identities: tuple[GpuIdentity, ...]
    readings: Mapping[int, GpuReading]
    processes: Mapping[int, tuple[GpuProcess, ...]]
    poll_seconds: float
    last_poll_unix: float | None = None
    """Unix time at which this poll completed; None before the first poll."""


def _down(poll_seconds: float = 0.0, last_poll_unix: float | None = None) -> GpuSnapshot:
    return GpuSnapshot(
        False, (), MappingProxyType({}), MappingProxyType({}), poll_seconds, last_poll_unix
    )


class GpuPoller:
    """Polls NVML at the daemon's interval into a cache; scrapes read only the cache.

    Example::

        poller = GpuPoller(PynvmlReader(), limiter=LogLimiter())
        poller.poll()  # never raises NvmlError: a driverless node just has nvml_up False
        for index, reading in poller.snapshot().readings.items():
            print(index, reading.power_watts)
        poller.close()
    """

    def __init__(
        self,
        reader: NvmlReader,
        *,
        limiter: LogLimiter,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._reader = reader
        self._limiter = limiter
        self._clock = clock
        self._wall_clock = wall_clock
        self._identities: tuple[GpuIdentity, ...] | None = None  # None while NVML is down
        self._unnamed: tuple[int, ...] = ()  # indices whose identity could not be read
        self._next_init = -math.inf
        self._next_naming = -math.inf
        # Bumped each time NVML comes up: log-once keys carry it, so every outage is logged.
        self._session = 0
        self._snapshot = _down()

    @property
    def nvml_up(self) -> bool:
        """Whether NVML answered at the last poll."""
        return self._snapshot.nvml_up

    def snapshot(self) -> GpuSnapshot:
        """The last poll's immutable snapshot (a cheap read: no NVML call)."""
        return self._snapshot

    def poll(self) -> None:
        """Read every GPU once, (re)initialising NVML first if it is down and the retry is due."""
        started = self._clock()
        identities = self._identities if self._identities is not None else self._start(started)
        if identities is None:
            self._snapshot = _down(self._clock() - started, self._wall_clock())
            return
        try:
            self._reader.driver_version()  # does NVML answer at all? One GPU failing is not that
        except NvmlError as error:
            self._limiter.once(
                f"nvml:{self._session}:lost:{error}",
                logging.WARNING,
                "stabmon daemon: NVML stopped answering (%s); GPU metrics are gone until it "
                "recovers (re-initialised at most every %.0f s)",
                error,
                _INIT_RETRY_SECONDS,
            )
            self._release()
            self._next_init = started + _INIT_RETRY_SECONDS
            self._snapshot = _down(self._clock() - started, self._wall_clock())
            return
        if self._unnamed and started >= self._next_naming:
            identities = self._name_again(started, identities)
        readings: dict[int, GpuReading] = {}
        processes: dict[int, tuple[GpuProcess, ...]] = {}
        for gpu in identities:
            polled = self._poll_gpu(gpu)
            if polled is not None:
                readings[gpu.index], processes[gpu.index] = polled
        self._snapshot = GpuSnapshot(
            nvml_up=True,
            identities=identities,
            readings=MappingProxyType(readings),
            processes=MappingProxyType(processes),
            poll_seconds=self._clock() - started,
            last_poll_unix=self._wall_clock(),
        )

    def close(self) -> None:
        """Shut NVML down if this poller initialised it."""
        if self._identities is not None:
            self._release()
        self._snapshot = _down()

    def _poll_gpu(self, gpu: GpuIdentity) -> tuple[GpuReading, tuple[GpuProcess, ...]] | None:
        """One GPU's reading and processes; None (logged) when the GPU itself fails."""
        try:
            reading = self._reader.reading(gpu.index)
        except NvmlError as error:
            self._log_gpu_left_out(gpu, error)
            return None
        for failure in reading.errors:
            self._limiter.once(
                f"nvml:{self._session}:field:{gpu.uuid}:{failure.call}",
                logging.WARNING,
                "stabmon daemon: GPU %d (%s): %s; that reading is left out while it fails",
                gpu.index,
                gpu.uuid,
                failure,
            )
        try:
            processes = tuple(self._reader.processes(gpu.index))
        except NvmlError as error:
            if error.gpu_lost:
                self._log_gpu_left_out(gpu, error)
                return None
            self._limiter.once(
                f"nvml:{self._session}:processes:{gpu.uuid}:{error.call}",
                logging.WARNING,
                "stabmon daemon: GPU %d (%s): %s; its process list is empty while it fails",
                gpu.index,
                gpu.uuid,
                error,
            )
            processes = ()
        return reading, processes

    def _log_gpu_left_out(self, gpu: GpuIdentity, error: NvmlError) -> None:
        self._limiter.once(
            f"nvml:{self._session}:gpu:{gpu.uuid}:{error}",
            logging.WARNING,
            "stabmon daemon: GPU %d (%s) left out of the metrics while it fails: %s",
            gpu.index,
            gpu.uuid,
            error,
        )

    def _start(self, now: float) -> tuple[GpuIdentity, ...] | None:
        """Initialise NVML and list the GPUs; None (logged once per error) when it fails."""
        if now < self._next_init:
            return None
        self._next_init = now + _INIT_RETRY_SECONDS
        try:
            self._reader.init()
        except NvmlError as error:
            # A node without a driver is a normal CPU node, not a problem worth a warning.
            level = logging.INFO if isinstance(error, NvmlUnavailable) else logging.WARNING
            self._log_init_failure(level, error)
            return None
        try:
            count = self._reader.device_count()
            driver = self._reader.driver_version()
        except NvmlError as error:
            self._release()
            self._log_init_failure(logging.WARNING, error)
            return None
        self._session += 1
        self._unnamed = tuple(range(count))
        identities = self._name_again(now, ())
        self._limiter.limited(
            "nvml:up",
            logging.INFO,
            "stabmon daemon: NVML up (driver %s), %d GPU(s): %s",
            driver,
            len(identities),
            ", ".join(f"{gpu.index}={gpu.uuid}" for gpu in identities),
        )
        return identities

    def _name_again(self, now: float, named: tuple[GpuIdentity, ...]) -> tuple[GpuIdentity, ...]:
        """Read the identities still missing; a GPU that fails stays out, the others are kept."""
        self._next_naming = now + _INIT_RETRY_SECONDS
        found = list(named)
        unnamed = []
        for index in self._unnamed:
            try:
                found.append(self._reader.identity(index))
            except NvmlError as error:
                unnamed.append(index)
                self._limiter.once(
                    f"nvml:{self._session}:identity:{index}:{error.call}",
                    logging.WARNING,
                    "stabmon daemon: GPU %d left out of the metrics: %s; retrying every %.0f s",
                    index,
                    error,
                    _INIT_RETRY_SECONDS,
                )
        self._unnamed = tuple(unnamed)
        self._identities = tuple(sorted(found, key=lambda gpu: gpu.index))
        return self._identities

    def _log_init_failure(self, level: int, error: NvmlError) -> None:
        self._limiter.once(
            f"nvml:{self._session}:init:{error}",
            level,
            "stabmon daemon: no GPU telemetry: %s; serving the other metrics and retrying "
            "every %.0f s",
            error,
            _INIT_RETRY_SECONDS,
        )

    def _release(self) -> None:
        self._identities = None
        self._unnamed = ()
        try:
            self._reader.shutdown()
        except NvmlError:
            pass  # NVML is already broken or gone; there is nothing left to release


# --- collector ------------------------------------------------------------------------------

_GAUGES: tuple[tuple[MetricDef, Callable[[GpuReading], float | None]], ...] = (
    (GPU_UTILIZATION, lambda reading: reading.utilization_ratio),
    (GPU_MEMORY_USED, lambda reading: reading.memory_used_bytes),
    (GPU_MEMORY_TOTAL, lambda reading: reading.memory_total_bytes),
    (GPU_TEMPERATURE, lambda reading: reading.temperature_celsius),
    (GPU_POWER, lambda reading: reading.power_watts),
    (GPU_SM_CLOCK, lambda reading: reading.sm_clock_hertz),
)

XidCounts = Mapping[tuple[int, str, int], int]
Samples = Iterable[tuple[tuple[str, ...], float]]


class GpuCollector(Collector):
    """The daemon's GPU families, built from the poller's last snapshot only.

    A field the GPU does not support (or that failed) is left out rather than
    exported as 0. XID counters appear with a GPU's first XID: NVML gives no
    list of the XIDs that could happen, and a made-up ``xid`` child would be
    worse than none. The poll's own health is ``{poller="nvml"}``.
    """

    def __init__(
        self, poller: GpuPoller, xid_counts: Callable[[], XidCounts] | None = None
    ) -> None:
        self._poller = poller
        self._xid_counts = xid_counts

    def collect(self) -> Iterator[Metric]:
        snapshot = self._poller.snapshot()
        yield _family(DAEMON_NVML_UP, [((), 1.0 if snapshot.nvml_up else 0.0)])
        gpus = [
            ((str(gpu.index), gpu.uuid), snapshot.readings[gpu.index])
            for gpu in snapshot.identities
            if gpu.index in snapshot.readings
        ]
        for definition, value_of in _GAUGES:
            yield _family(
                definition,
                [(labels, value) for labels, r in gpus if (value := value_of(r)) is not None],
            )
        yield _family(
            GPU_THROTTLE_ACTIVE,
            [
                ((*labels, reason), 1.0 if reason in r.throttle_reasons else 0.0)
                for labels, r in gpus
                if r.throttle_reasons is not None
                for reason in THROTTLE_REASONS
            ],
        )
        yield _family(
            GPU_ECC_ERRORS,
            [
                ((*labels, kind), count)
                for labels, r in gpus
                for kind, count in (
                    ("corrected", r.ecc_corrected),
                    ("uncorrected", r.ecc_uncorrected),
                )
                if count is not None
            ],
        )
        counts = self._xid_counts() if self._xid_counts is not None else {}
        yield _family(
            GPU_XID_ERRORS,
            [((str(index), uuid, str(xid)), n) for (index, uuid, xid), n in sorted(counts.items())],
        )


def _family(definition: MetricDef, samples: Samples) -> Metric:
    return family(definition, samples)
