"""The daemon's GPU telemetry: a poller caches NVML readings, a collector reads the cache.

Design
------
Only the daemon's poll thread calls :meth:`GpuPoller.poll`, and a poll is the
only place NVML is read for metrics (the XID thread waits on its own event set,
see :mod:`stabmon.daemon.xid_events`). Each poll builds a new immutable
:class:`GpuSnapshot` and swaps it in with one assignment, atomic in CPython, so
the scrape thread's :class:`GpuCollector` reads a consistent snapshot without a
lock and returns in milliseconds whatever NVML is doing.

NVML's state is one of two: down (never initialised, no driver, or it stopped
answering: ``stabmon_daemon_nvml_up`` 0, no GPU series, init retried at most
every 60 s) or up (every GPU polled; a GPU that fails is left out of that poll
and logged once, the others are kept).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stabmon.contract import DAEMON_METRICS, THROTTLE_REASONS, MetricDef
from stabmon.daemon.nvml import (
    GpuIdentity,
    GpuProcess,
    GpuReading,
    NvmlError,
    NvmlReader,
    NvmlUnavailable,
)
from stabmon.log import LogLimiter

__all__ = ["GpuCollector", "GpuPoller", "GpuSnapshot"]

#: A failed init is retried at most this often: a driverless node must not pay for it every poll.
_INIT_RETRY_SECONDS = 60.0


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


def _down(poll_seconds: float = 0.0) -> GpuSnapshot:
    return GpuSnapshot(False, (), MappingProxyType({}), MappingProxyType({}), poll_seconds)


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
    ) -> None:
        self._reader = reader
        self._limiter = limiter
        self._clock = clock
        self._identities: tuple[GpuIdentity, ...] | None = None  # None while NVML is down
        self._next_init = -math.inf
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
            self._snapshot = _down(self._clock() - started)
            return
        try:
            self._reader.driver_version()  # does NVML answer at all? One GPU failing is not that
        except NvmlError as error:
            self._limiter.once(
                f"nvml:lost:{error}",
                logging.WARNING,
                "stabmon daemon: NVML stopped answering (%s); GPU metrics are gone until it "
                "recovers (re-initialised at most every %.0f s)",
                error,
                _INIT_RETRY_SECONDS,
            )
            self._release()
            self._next_init = started + _INIT_RETRY_SECONDS
            self._snapshot = _down(self._clock() - started)
            return
        readings: dict[int, GpuReading] = {}
        processes: dict[int, tuple[GpuProcess, ...]] = {}
        for gpu in identities:
            try:
                readings[gpu.index] = self._reader.reading(gpu.index)
                processes[gpu.index] = tuple(self._reader.processes(gpu.index))
            except NvmlError as error:
                readings.pop(gpu.index, None)
                self._limiter.once(
                    f"nvml:gpu:{gpu.uuid}:{error}",
                    logging.WARNING,
                    "stabmon daemon: GPU %d (%s) left out of the metrics while it fails: %s",
                    gpu.index,
                    gpu.uuid,
                    error,
                )
        self._snapshot = GpuSnapshot(
            nvml_up=True,
            identities=identities,
            readings=MappingProxyType(readings),
            processes=MappingProxyType(processes),
            poll_seconds=self._clock() - started,
        )

    def close(self) -> None:
        """Shut NVML down if this poller initialised it."""
        if self._identities is not None:
            self._release()
        self._snapshot = _down()

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
            identities = tuple(self._reader.devices())
            driver = self._reader.driver_version()
        except NvmlError as error:
            self._release()
            self._log_init_failure(logging.WARNING, error)
            return None
        self._identities = identities
        self._limiter.limited(
            "nvml:up",
            logging.INFO,
            "stabmon daemon: NVML up (driver %s), %d GPU(s): %s",
            driver,
            len(identities),
            ", ".join(f"{gpu.index}={gpu.uuid}" for gpu in identities),
        )
        return identities

    def _log_init_failure(self, level: int, error: NvmlError) -> None:
        self._limiter.once(
            f"nvml:init:{error}",
            level,
            "stabmon daemon: no GPU telemetry: %s; serving the other metrics and retrying "
            "every %.0f s",
            error,
            _INIT_RETRY_SECONDS,
        )

    def _release(self) -> None:
        self._identities = None
        try:
            self._reader.shutdown()
        except NvmlError:
            pass  # NVML is already broken or gone; there is nothing left to release


# --- collector ------------------------------------------------------------------------------

_CONTRACT = {definition.name: definition for definition in DAEMON_METRICS}
# A name the contract lacks fails here, at import, not at the first scrape.
_NVML_UP = _CONTRACT["stabmon_daemon_nvml_up"]
_UTILIZATION = _CONTRACT["stabmon_gpu_utilization_ratio"]
_MEMORY_USED = _CONTRACT["stabmon_gpu_memory_used_bytes"]
_MEMORY_TOTAL = _CONTRACT["stabmon_gpu_memory_total_bytes"]
_TEMPERATURE = _CONTRACT["stabmon_gpu_temperature_celsius"]
_POWER = _CONTRACT["stabmon_gpu_power_watts"]
_SM_CLOCK = _CONTRACT["stabmon_gpu_sm_clock_hertz"]
_THROTTLE_ACTIVE = _CONTRACT["stabmon_gpu_throttle_active"]
_ECC_ERRORS = _CONTRACT["stabmon_gpu_ecc_errors_total"]
_XID_ERRORS = _CONTRACT["stabmon_gpu_xid_errors_total"]

_GAUGES: tuple[tuple[MetricDef, Callable[[GpuReading], float | None]], ...] = (
    (_UTILIZATION, lambda reading: reading.utilization_ratio),
    (_MEMORY_USED, lambda reading: reading.memory_used_bytes),
    (_MEMORY_TOTAL, lambda reading: reading.memory_total_bytes),
    (_TEMPERATURE, lambda reading: reading.temperature_celsius),
    (_POWER, lambda reading: reading.power_watts),
    (_SM_CLOCK, lambda reading: reading.sm_clock_hertz),
)

XidCounts = Mapping[tuple[int, str, int], int]
Samples = Iterable[tuple[tuple[str, ...], float]]


class GpuCollector(Collector):
    """The daemon's GPU families, built from the poller's last snapshot only.

    A field the GPU does not support is left out rather than exported as 0.
    XID counters appear with a GPU's first XID: NVML gives no list of the XIDs
    that could happen, and a made-up ``xid`` child would be worse than none.
    """

    def __init__(
        self, poller: GpuPoller, xid_counts: Callable[[], XidCounts] | None = None
    ) -> None:
        self._poller = poller
        self._xid_counts = xid_counts

    def collect(self) -> Iterator[Metric]:
        snapshot = self._poller.snapshot()
        yield _family(_NVML_UP, [((), 1.0 if snapshot.nvml_up else 0.0)])
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
            _THROTTLE_ACTIVE,
            [
                ((*labels, reason), 1.0 if reason in r.throttle_reasons else 0.0)
                for labels, r in gpus
                if r.throttle_reasons is not None
                for reason in THROTTLE_REASONS
            ],
        )
        yield _family(
            _ECC_ERRORS,
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
            _XID_ERRORS,
            [((str(index), uuid, str(xid)), n) for (index, uuid, xid), n in sorted(counts.items())],
        )


def _family(definition: MetricDef, samples: Samples) -> Metric:
    family: CounterMetricFamily | GaugeMetricFamily
    if definition.type == "counter":
        family = CounterMetricFamily(definition.name, definition.help, labels=definition.labels)
    else:
        family = GaugeMetricFamily(definition.name, definition.help, labels=definition.labels)
    for labels, value in samples:
        family.add_metric(list(labels), float(value))
    return family
