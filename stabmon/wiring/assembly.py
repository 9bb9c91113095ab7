"""Builds what one Monitor is made of, at attach: probes, recorder, exporter and threads.

:class:`Assembly` makes the parts the hooks use (readings, recorder, gradient probe and
readback, loop timer, throughput, the plug-ins and their Context) as its attributes;
:meth:`~Assembly.serve` starts the exporter; :meth:`~Assembly.start_threads` starts the
watchdog, the stall responder and the periodic threads; :meth:`~Assembly.announce`
writes the attach record and logs where things are.
Everything that must be closed goes into the Monitor's
:class:`~stabmon.wiring.resources.Resources`; nothing built here holds the Monitor (the
judge thread gets a callable that holds the step hooks weakly).

One clock (``clock``, ``time.perf_counter`` unless a test injects one) drives the loop
timer, the heartbeat and the stall watchdog: the timer's reading at a step's end is
the beat, and the watchdog ages it on the same clock.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from stabmon._version import __version__
from stabmon.config import Config
from stabmon.detectors.stall import Heartbeat, StallWatchdog
from stabmon.export.collector import PluginCollector, ReadingsCollector
from stabmon.export.contained import ContainedCollector
from stabmon.export.event_log import EventLog
from stabmon.export.exporter import Exporter, Security, address_note, candidate_ports
from stabmon.export.hang_collector import HangCollector
from stabmon.extension import Factory
from stabmon.pipeline.judging import QUIET_POLL_SECONDS
from stabmon.pipeline.measurements import Measurements
from stabmon.pipeline.readings import Readings
from stabmon.pipeline.recorder import Recorder
from stabmon.pipeline.throughput import build_throughput
from stabmon.probes.batch_identity import BatchIdentities
from stabmon.probes.collectives import CollectiveCounter
from stabmon.probes.device_timing import TIMED_STEPS, DeviceTimer, recorder_for
from stabmon.probes.environment import build_info, describe_environment
from stabmon.probes.grads import GradProbe
from stabmon.probes.loader import WorkerWatch
from stabmon.probes.memory import HostMemory, MemorySampler, cuda_devices
from stabmon.probes.placement import PlacementWatch
from stabmon.probes.timing import LoopTimer
from stabmon.probes.worker_stacks import WorkerStacks
from stabmon.shared.background import PeriodicThread
from stabmon.shared.guard import Guard
from stabmon.shared.log import LOGGER, LogLimiter
from stabmon.shared.own_record import Registration
from stabmon.shared.rundir import DEFAULT_RUN_DIR, RunPaths
from stabmon.wiring.context import PluginContext
from stabmon.wiring.hooks import unwrap_model
from stabmon.wiring.plugins import Plugged
from stabmon.wiring.registration import check_local_rank, report_misplaced
from stabmon.wiring.resources import Resources
from stabmon.wiring.stall_action import StallResponder

__all__ = ["Assembly"]


class Assembly:
    """What one Monitor is made of, built at attach; the hooks' and public methods' parts.

    Built not yet running (no thread, no hook, no server): :meth:`serve`,
    :meth:`start_threads` and :meth:`announce` start it. None of it refers to the Monitor.
    """

    def __init__(
        self,
        config: Config,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        run_id: str,
        rank: int,
        plugins: Sequence[Factory],
        guard: Guard,
        limiter: LogLimiter,
        resources: Resources,
        clock: Callable[[], float],
    ) -> None:
        self.config, self.run_id, self.rank = config, run_id, rank
        self._guard, self._limiter, self._resources, self._clock = guard, limiter, resources, clock
        self.readings = readings = Readings(
            labels={"rank": str(rank), "run": run_id}, build_info=build_info(__version__)
        )
        self.paths = paths = _run_paths(config, run_id, rank)
        if config.event_log:
            resources.events = EventLog(
                paths.events, common={"run": run_id, "rank": rank}, guard=guard
            )
        self.plugged = plugged = Plugged(guard)
        self.recorder = recorder = Recorder(
            config, readings, events=resources.events, limiter=limiter,
            on_anomaly=plugged.anomaly_recorded,
        )  # fmt: skip
        self.placement = _placement(config, model, recorder)
        self.heartbeat = heartbeat = Heartbeat(clock)
        loop_started = clock()  # at or before the loop timer's first mark
        self.measurements = measurements = Measurements(
            model, optimizer, config, readings=readings, recorder=recorder, plugged=plugged,
            guard=guard, limiter=limiter,
        )  # fmt: skip
        probe = measurements.probe
        self.devices = devices = cuda_devices(probe.params) if probe else ()
        self.memory = _memory_sampler(readings, guard, probe)
        self.device_timer = device_timer = _device_timer(readings, devices, clock)
        context = PluginContext(
            config, model, optimizer, readings=readings, memory=self.memory, heartbeat=heartbeat,
            run_directory=paths.run_directory, rank=rank, recorder=recorder,
            engine=measurements.engine, hooks=resources.hooks,
            gradient_norms=measurements.current_norms,
        )  # fmt: skip
        #: What the plug-ins read; its optimizer changes at Monitor.bind_optimizer().
        self.context = context
        self.batches = BatchIdentities(context)  # fed by the step hooks and observe()
        plugged.plug(context, extra=(lambda _: self.batches, *plugins))
        self.timer = LoopTimer(
            readings, heartbeat, clock=clock,
            device_mark=device_timer.mark if device_timer else None,
        )  # fmt: skip
        self.throughput = build_throughput(
            config.throughput, readings, model=unwrap_model(model), devices=devices,
            parameters=probe.params if probe else (), started=loop_started,
            context=context, limiter=limiter,
        )  # fmt: skip
        self.workers = WorkerWatch(recorder.worker_died)
        self.registry = _registry(readings, plugged, guard)

    # --- starting it ------------------------------------------------------------------------

    def serve(self, *, local_rank: int, local_world_size: int) -> None:
        """Start the exporter (when ``serve_metrics``) on the first free candidate port."""
        config = self.config
        if not config.serve_metrics:
            return
        ports = candidate_ports(config.port, local_rank, local_world_size, config.port_attempts)
        with self._guard.contain("exporter"):
            exporter = Exporter(
                self.registry, address=config.address, ports=ports, limiter=self._limiter,
                security=Security.from_config(config), guard=self._guard,
                cache_seconds=config.scrape_cache_seconds,
            )  # fmt: skip
            if exporter.start():
                self._resources.exporter = exporter

    def start_threads(self, judge_quiet: Callable[[], None]) -> None:
        """Count collectives, then start the watchdog, stall responder and periodic threads.

        ``judge_quiet`` is the judge thread's task (it must hold the Monitor weakly).
        """
        config, guard, resources = self.config, self._guard, self._resources
        watchdog, responder = self._stall_watch()
        poll = min(0.25, config.stall_seconds / 4) if config.stall_seconds else 0.25
        every = config.sample_seconds
        threads = [
            PeriodicThread(
                "stabmon-watchdog", poll, watchdog.check, guard=guard, component="stall"
            ),
            PeriodicThread(
                "stabmon-stall-action", poll, responder.poll, guard=guard, component="stall"
            ),
            PeriodicThread(
                "stabmon-judge", QUIET_POLL_SECONDS, judge_quiet, guard=guard, component="readback"
            ),
            PeriodicThread(
                "stabmon-sampler", every, self.memory.sample, guard=guard, component="memory"
            ),
            # The worker check holds the recorder, not the Monitor.
            PeriodicThread(
                "stabmon-loader", every, self.workers.check, guard=guard, component="hooks"
            ),
        ]
        registration = resources.registration
        if registration is not None:
            beat = _heartbeat_writer(registration, self.heartbeat, watchdog, self.readings,
                                     self.recorder)  # fmt: skip
            threads.append(
                PeriodicThread("stabmon-heartbeat", every, beat, guard=guard, component="rundir")
            )
        resources.threads = threads
        with guard.contain("memory"):
            self.memory.sample()
        for thread in threads:
            thread.start()

    def _stall_watch(self) -> tuple[StallWatchdog, StallResponder]:
        """The stall watchdog, what it does about a stall, and the hang metrics it exposes."""
        config, guard, resources, clock = self.config, self._guard, self._resources, self._clock
        run_id, rank, paths = self.run_id, self.rank, self.paths
        collectives = CollectiveCounter()
        with guard.contain("hooks"):
            collectives.install()
            resources.collectives = collectives
        heartbeat = self.heartbeat
        worker_stacks = resources.worker_stacks = WorkerStacks(paths.run_directory, rank=rank)
        responder = StallResponder(
            action=config.stall_action, grace_seconds=config.stall_grace_seconds, rank=rank,
            run=run_id, recorder=self.recorder, heartbeat=heartbeat, collectives=collectives,
            registration=resources.registration, run_directory=paths.run_directory,
            root=paths.root, worker_stacks=worker_stacks, workers=self.workers,
            clock=clock,  # its grace period, node-records cache and flight-read interval
        )  # fmt: skip
        self.registry.register(
            ContainedCollector(
                HangCollector(
                    self.readings.labels,
                    phase=lambda: heartbeat.phase,
                    collectives=lambda: collectives.issued,
                    in_collective=lambda: collectives.current is not None,
                    hang_state=lambda: responder.state,
                ),
                guard=guard,
                component="exporter",
            )
        )
        watchdog = StallWatchdog(
            heartbeat,
            stall_seconds=config.stall_seconds,
            phase_stall_seconds=config.phase_stall_seconds,
            on_stall=responder.stalled,
            on_recover=responder.resumed,
            clock=clock,
            peer_phase=responder.peer_phase,
        )
        return watchdog, responder

    def announce(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        metrics_url: str | None,
        event_log_path: Path | None,
    ) -> None:
        """The attach record (environment, config), the identity checks, the log line."""
        config, guard, run_id, rank = self.config, self._guard, self.run_id, self.rank
        probe = self.measurements.probe
        environment, gpus = describe_environment(self.readings.build_info, self.devices, guard)
        if gpus:
            self.readings.device_info = gpus
        self.recorder.write(
            "attach", environment=environment, config=config.to_dict(), pid=os.getpid(),
            metrics_url=metrics_url, parameters=len(probe.names) if probe else 0,
            module_groups=list(probe.groups) if probe else [],
        )  # fmt: skip
        check_local_rank(self.recorder, guard)
        if self.placement is not None:  # after the attach record, which opens the event log
            self.placement.audit(unwrap_model(model), optimizer)  # raises only in raise mode
        LOGGER.info(
            "stabmon: attached (run %s, rank %d); metrics at %s%s; events in %s",
            run_id,
            rank,
            metrics_url or "(no exporter)",
            address_note(config.address) if metrics_url else "",  # the bind's trade-off
            event_log_path or "(no event log)",
        )


def _registry(readings: Readings, plugged: Plugged, guard: Guard) -> CollectorRegistry:
    """The Monitor's own registry: its readings, and each publishing plug-in, contained."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReadingsCollector(readings, guard.counts))
    for plugin in plugged.publishing:
        registry.register(
            ContainedCollector(
                PluginCollector(readings.labels, plugin), guard=guard, component=plugin.component
            )
        )
    return registry


def _run_paths(config: Config, run_id: str, rank: int) -> RunPaths:
    root = Path(config.run_dir) if config.run_dir else DEFAULT_RUN_DIR
    return RunPaths(root=root, run_id=run_id, rank=rank)


def _device_timer(
    readings: Readings, devices: Sequence[torch.device], clock: Callable[[], float]
) -> DeviceTimer | None:
    """Phase times on the first CUDA device's stream, fast steps (on the loop clock) sampled;
    None on a CPU loop."""
    if not devices:
        return None
    return DeviceTimer(readings, record=recorder_for(devices[0]), every=TIMED_STEPS, clock=clock)


def _placement(config: Config, model: torch.nn.Module, recorder: Recorder) -> PlacementWatch | None:
    if config.device_check == "off":
        return None
    named = list(unwrap_model(model).named_parameters())
    return PlacementWatch(config.device_check, named, functools.partial(report_misplaced, recorder))


def _memory_sampler(readings: Readings, guard: Guard, probe: GradProbe | None) -> MemorySampler:
    host: HostMemory | None = None
    with guard.contain("memory"):
        host = HostMemory()
    return MemorySampler(readings, host, lambda: cuda_devices(probe.params) if probe else ())


def _heartbeat_writer(
    registration: Registration,
    heartbeat: Heartbeat,
    watchdog: StallWatchdog,
    readings: Readings,
    recorder: Recorder,
) -> Callable[[], None]:
    """The heartbeat thread's task: the run-directory record, brought up to date."""

    def beat() -> None:  # captures no Monitor: a dropped Monitor can be collected
        for _ in range(3):
            # One phase with its own limit: a phase edge between the two reads would
            # write a checkpoint with the step limit, which the peers read as stalled.
            phase = heartbeat.phase
            limit = watchdog.limit_seconds()
            if heartbeat.phase == phase:
                break
        registration.write(
            last_step_unix=readings.last_step_unix,
            steps=recorder.global_step,
            now=time.time(),
            phase=phase,
            stall_limit_seconds=limit,
        )

    return beat
