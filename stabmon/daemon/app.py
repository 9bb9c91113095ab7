"""The daemon's lifecycle: two poll threads, one HTTP endpoint, a clean stop on SIGTERM, SIGINT
or SIGHUP.

Design
------
NVML (:class:`~stabmon.daemon.gpu.GpuPoller`) and the registered training
processes (:class:`~stabmon.daemon.processes.ProcessTable`, then their GPU
placement) are polled every ``daemon.interval`` seconds by two threads of their
own: an NVML call on a sick GPU can block for minutes, and liveness and
heartbeats must keep flowing exactly then. Each poll writes immutable
snapshots; collectors build the metric families from the last snapshot, so a
scrape never calls NVML or psutil and returns in milliseconds. XID events are
read by a third thread, because NVML's event wait blocks. Every poll runs under
the guard: a failure is counted in ``stabmon_internal_errors_total``, logged
once, and the daemon keeps serving the rest; it never exits on its own.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import ProcessCollector as OwnProcessCollector
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from stabmon import contract
from stabmon.config import Config
from stabmon.daemon import discovery, health
from stabmon.daemon.gpu import GpuCollector, GpuPoller
from stabmon.daemon.hang import NodeHangCollector, NodeHangJudge
from stabmon.daemon.liveness import HostMemoryCollector, LivenessCollector
from stabmon.daemon.placement import PlacementCollector
from stabmon.daemon.processes import ProcessCollector, ProcessTable
from stabmon.daemon.xid_events import XidWatcher
from stabmon.daemon.xid_state import XidState, XidStateCollector, state_path
from stabmon.export.contained import ContainedCollector
from stabmon.export.exporter import Exporter, Security, address_note
from stabmon.export.families import family
from stabmon.hardware.nvml import NvmlReader, PynvmlReader
from stabmon.shared.background import PeriodicThread
from stabmon.shared.guard import Guard
from stabmon.shared.log import LOGGER, LogLimiter
from stabmon.shared.rundir import DEFAULT_RUN_DIR

__all__ = ["DaemonApp"]

_COMPONENTS = ("nvml", "processes", "placement", "xid", "exporter", "rundir")
#: How long stop() may take in all: every thread is signalled first, then joined against it.
STOP_SECONDS = 1.0


class DaemonApp:
    """``stabmon daemon``: GPU, process and liveness telemetry for one node."""

    def __init__(
        self,
        config: Config,
        *,
        reader: NvmlReader | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir) if config.run_dir else DEFAULT_RUN_DIR
        self._limiter = LogLimiter(LOGGER, per_minute=config.log_rate_per_minute)
        self._guard = Guard(self._limiter, _COMPONENTS)
        self._reader = reader if reader is not None else PynvmlReader(lock_timeout=0.2)
        self._gpus = GpuPoller(self._reader, limiter=self._limiter)
        self._processes = ProcessTable(
            self.run_dir, limiter=self._limiter, on_refused=self._count_refused
        )
        self._placement = PlacementCollector(limiter=self._limiter)
        self._hangs = NodeHangJudge(limiter=self._limiter)
        self._xid_state = XidState(state_path(self.run_dir), limiter=self._limiter)
        self._xid = XidWatcher(
            self._reader,
            lambda: self._gpus.snapshot().identities,
            guard=self._guard,
            limiter=self._limiter,
            state=self._xid_state,
        )
        self._health = _HealthCollector(self._guard, self._gpus)
        self.registry = registry if registry is not None else CollectorRegistry()
        # Each contained: one that fails is counted and logged once, the others still serve.
        for collector in (
            GpuCollector(self._gpus, self._xid.counts),
            ProcessCollector(self._processes),
            self._placement,
            LivenessCollector(self._processes),
            HostMemoryCollector(),
            XidStateCollector(self._xid_state),
            NodeHangCollector(self._hangs),
        ):
            self.registry.register(
                ContainedCollector(collector, guard=self._guard, component="exporter")
            )
        self.registry.register(self._health)
        OwnProcessCollector(registry=self.registry)  # the daemon's own CPU and memory
        self._exporter: Exporter | None = None
        interval = config.daemon.interval
        self._threads = [
            PeriodicThread(
                "stabmon-daemon-nvml", interval, self.poll_gpus, guard=self._guard, component="nvml"
            ),
            PeriodicThread(
                "stabmon-daemon-processes",
                interval,
                self.poll_processes,
                guard=self._guard,
                component="processes",
            ),
        ]
        self._stopped = threading.Event()

    @property
    def url(self) -> str | None:
        return self._exporter.url if self._exporter else None

    def _count_refused(self, count: int) -> None:
        """Records (or the root) refused by trust by owner: ``{component="rundir"}``."""
        for _ in range(count):
            self._guard.count("rundir")

    def _targets(self, environ: Mapping[str, Any]) -> tuple[str, bytes]:
        """``GET /targets``: Prometheus HTTP service discovery of this node's ranks."""
        return discovery.targets_response(self._processes.samples(), environ)

    def poll_gpus(self) -> None:
        """One NVML poll (the NVML thread)."""
        with self._guard.contain("nvml"):
            self._gpus.poll()

    def poll_processes(self) -> None:
        """One poll of the registered processes and their GPU placement (the processes thread)."""
        started = time.monotonic()
        with self._guard.contain("processes"):
            samples = self._processes.poll()
            with self._guard.contain("processes"):
                self._hangs.update(samples)  # the node's hang verdict, from the same poll
            with self._guard.contain("placement"):
                snapshot = self._gpus.snapshot()
                self._placement.update(
                    samples,
                    {
                        index: [(p.pid, p.used_bytes) for p in procs]
                        for index, procs in snapshot.processes.items()
                    },  # fmt: skip
                    {identity.index: identity.uuid for identity in snapshot.identities},
                    self._reader.mig_parent_uuid if snapshot.nvml_up else _no_parent,
                )
            self._health.processes_polled(time.monotonic() - started, time.time())

    def poll_once(self) -> None:
        """Both polls, in order (start-up, and tests)."""
        self.poll_gpus()
        self.poll_processes()

    def start(self) -> bool:
        """Poll once, serve, and start the background threads; False when the port is taken."""
        self.poll_once()
        daemon = self.config.daemon
        self._exporter = Exporter(
            self.registry,
            address=daemon.address,
            ports=[daemon.port],
            limiter=self._limiter,
            routes={discovery.PATH: self._targets},
            security=Security.from_config(self.config),
            guard=self._guard,
            cache_seconds=self.config.scrape_cache_seconds,
            public_routes={health.PATH: health.healthz},
        )
        if not self._exporter.start():
            self._gpus.close()
            return False
        for thread in self._threads:
            thread.start()
        self._xid.start()  # registers XID events whenever NVML is (or becomes) available
        LOGGER.info(
            "stabmon daemon: serving %s%s; run directory %s; polling every %.1f s; NVML %s",
            self.url,
            address_note(daemon.address),
            self.run_dir,
            daemon.interval,
            "up" if self._gpus.nvml_up else "unavailable",
        )
        return True

    def stop(self) -> None:
        """Stop every thread and the server within about ``STOP_SECONDS``."""
        deadline = time.monotonic() + STOP_SECONDS
        self._stopped.set()
        for thread in self._threads:
            thread.request_stop()
        self._xid.request_stop()
        if self._exporter is not None:
            self._exporter.stop(deadline - time.monotonic())
        for thread in self._threads:
            thread.join(deadline - time.monotonic())
        self._xid.stop(max(deadline - time.monotonic(), 0.0))
        if not self._threads[0].alive:  # never shut NVML down under a call still in flight
            self._gpus.close()

    def run_until_signalled(self, ready: Callable[[], None] | None = None) -> None:
        """Serve until SIGTERM, SIGINT or SIGHUP, then stop cleanly (the CLI's main loop).

        SIGHUP is a stop, not a reload: a daemon whose terminal closes, or whose supervisor
        sends it for a config change, ends its threads and frees its port, and the
        supervisor starts it again with the new config (nothing is half reloaded). ``ready``
        is called once the handlers are in place (the CLI prints its serving line there).
        """

        def on_signal(signum: int, frame: FrameType | None) -> None:
            LOGGER.info("stabmon daemon: %s, stopping", signal.Signals(signum).name)
            self._stopped.set()

        stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        previous = {sig: signal.signal(sig, on_signal) for sig in stops}
        try:
            if ready is not None:  # only now: a signal sent on seeing it is a clean stop
                ready()
            while not self._stopped.wait(0.1):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            started = time.monotonic()
            self.stop()
            LOGGER.info("stabmon daemon: stopped in %.2f s", time.monotonic() - started)


def _no_parent(uuid: str) -> str | None:
    return None


class _HealthCollector(Collector):
    """The daemon's contained errors and both pollers' timing (one family per name)."""

    def __init__(self, guard: Guard, gpus: GpuPoller) -> None:
        self._guard = guard
        self._gpus = gpus
        self._poll: tuple[float, float] | None = None

    def processes_polled(self, seconds: float, at_unix: float) -> None:
        self._poll = (seconds, at_unix)

    def collect(self) -> Iterator[Metric]:
        counts = dict(self._guard.counts).items()
        yield family(contract.INTERNAL_ERRORS, [([component], n) for component, n in counts])
        polls: dict[str, tuple[float, float]] = {}
        gpus = self._gpus.snapshot()
        if gpus.last_poll_unix is not None:
            polls["nvml"] = (gpus.poll_seconds, gpus.last_poll_unix)
        if self._poll is not None:
            polls["processes"] = self._poll
        duration = family(contract.DAEMON_POLL_DURATION)
        last = family(contract.DAEMON_LAST_POLL)
        for poller, (seconds, at_unix) in polls.items():
            duration.add_metric([poller], seconds)
            last.add_metric([poller], at_unix)
        yield duration
        yield last
