"""The daemon's lifecycle: one poll loop, one HTTP endpoint, a clean stop on SIGTERM/SIGINT.

Design
------
One poll thread runs every ``daemon.interval`` seconds: NVML (through
:class:`~stabmon.daemon.gpu.GpuPoller`), the registered training processes
(:class:`~stabmon.daemon.processes.ProcessTable`) and their GPU placement.
Each poll writes immutable snapshots; collectors build the metric families
from the last snapshot, so a scrape never calls NVML or psutil and returns in
milliseconds whatever the hardware is doing. XID events are read by their own
thread, because NVML's event wait blocks. Every poll runs under the guard: an
NVML or psutil failure is logged once and the daemon keeps serving the rest;
it never exits on its own.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry
from prometheus_client import ProcessCollector as OwnProcessCollector

from stabmon.background import PeriodicThread
from stabmon.config import Config
from stabmon.daemon.gpu import GpuCollector, GpuPoller
from stabmon.daemon.nvml import NvmlReader, PynvmlReader
from stabmon.daemon.placement import PlacementCollector
from stabmon.daemon.processes import ProcessCollector, ProcessTable
from stabmon.daemon.xid_events import XidWatcher
from stabmon.export.exporter import Exporter
from stabmon.guard import Guard
from stabmon.log import LOGGER, LogLimiter
from stabmon.rundir import DEFAULT_RUN_DIR

__all__ = ["DaemonApp"]

_COMPONENTS = ("nvml", "processes", "placement", "xid", "exporter")


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
        self._reader = reader if reader is not None else PynvmlReader()
        self._gpus = GpuPoller(self._reader, limiter=self._limiter)
        self._processes = ProcessTable(self.run_dir, limiter=self._limiter)
        self._placement = PlacementCollector(limiter=self._limiter)
        self._xid = XidWatcher(
            self._reader,
            lambda: self._gpus.snapshot().identities,
            guard=self._guard,
            limiter=self._limiter,
        )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(GpuCollector(self._gpus, self._xid.counts))
        self.registry.register(ProcessCollector(self._processes))
        self.registry.register(self._placement)
        OwnProcessCollector(registry=self.registry)  # the daemon's own CPU and memory
        self._exporter: Exporter | None = None
        self._poller = PeriodicThread(
            "stabmon-daemon-poll",
            config.daemon.interval,
            self.poll_once,
            guard=self._guard,
            component="processes",
        )
        self._stopped = threading.Event()

    @property
    def url(self) -> str | None:
        return self._exporter.url if self._exporter else None

    def poll_once(self) -> None:
        """One poll of NVML, the registered processes and their placement."""
        with self._guard.contain("nvml"):
            self._gpus.poll()
        with self._guard.contain("processes"):
            samples = self._processes.poll()
        with self._guard.contain("placement"):
            snapshot = self._gpus.snapshot()
            self._placement.update(
                samples,
                {
                    index: [(p.pid, p.used_bytes) for p in procs]
                    for index, procs in snapshot.processes.items()
                },  # fmt: skip
                {identity.index: identity.uuid for identity in snapshot.identities},
                self._reader.mig_parent_uuid if snapshot.nvml_up else (lambda uuid: None),
            )

    def start(self) -> bool:
        """Poll once, serve, and start the background threads; False when no port could be bound."""
        self.poll_once()
        daemon = self.config.daemon
        self._exporter = Exporter(
            self.registry, address=daemon.address, ports=[daemon.port], limiter=self._limiter
        )
        if not self._exporter.start():
            return False
        self._poller.start()
        if self._gpus.nvml_up:
            self._xid.start()
        LOGGER.info(
            "stabmon daemon: serving %s; run directory %s; polling every %.1f s; NVML %s",
            self.url,
            self.run_dir,
            daemon.interval,
            "up" if self._gpus.nvml_up else "unavailable",
        )
        return True

    def stop(self) -> None:
        """Stop every thread and the server; returns within about a second."""
        self._stopped.set()
        self._poller.stop()
        self._xid.stop()
        if self._exporter is not None:
            self._exporter.stop()
        self._gpus.close()

    def run_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT, then stop cleanly (the CLI's main loop)."""

        def on_signal(signum: int, frame: FrameType | None) -> None:
            LOGGER.info("stabmon daemon: %s, stopping", signal.Signals(signum).name)
            self._stopped.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not self._stopped.wait(0.2):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            started = time.monotonic()
            self.stop()
            logging.getLogger("stabmon").info(
                "stabmon daemon: stopped in %.2f s", time.monotonic() - started
            )
