"""Builds what one Monitor is made of, at attach: probes, recorder, exporter and threads.

:func:`build` makes the parts the hooks use (readings, recorder, gradient probe and
readback, loop timer, throughput, the plug-ins); :func:`serve` starts the exporter;
:func:`start_threads` starts the watchdog, the stall responder and the periodic
threads; :func:`announce` writes the attach record and logs where things are.
Everything that must be closed goes into the Monitor's
:class:`~stabmon.resources.Resources`; nothing built here holds the Monitor (the
judge thread gets a callable that holds the step hooks weakly).

One clock (``clock``, ``time.perf_counter`` unless a test injects one) drives the loop
timer, the heartbeat and the stall watchdog: the timer's reading at a step's end is
the beat, and the watchdog ages it on the same clock.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from stabmon._version import __version__
from stabmon.background import PeriodicThread
from stabmon.config import Config
from stabmon.detectors.stall import Heartbeat, StallWatchdog
from stabmon.export.collector import PluginCollector, ReadingsCollector
from stabmon.export.contained import ContainedCollector
from stabmon.export.event_log import EventLog
from stabmon.export.exporter import Exporter, Security, candidate_ports
from stabmon.export.hang_collector import HangCollector
from stabmon.extension import Attachment
from stabmon.guard import Guard
from stabmon.hooks import unwrap_model
from stabmon.judging import QUIET_POLL_SECONDS
from stabmon.log import LOGGER, LogLimiter
from stabmon.measurements import Measurements
from stabmon.plugins import Plugged
from stabmon.probes.collectives import CollectiveCounter
from stabmon.probes.device_timing import DeviceTimer, recorder_for
from stabmon.probes.environment import build_info, describe_environment
from stabmon.probes.loader import WorkerWatch
from stabmon.probes.memory import HostMemory, MemorySampler, cuda_devices
from stabmon.probes.placement import PlacementWatch
from stabmon.probes.timing import LoopTimer
from stabmon.probes.worker_stacks import WorkerStacks
from stabmon.readings import Readings
from stabmon.recorder import Recorder
from stabmon.registration import check_local_rank, report_misplaced
from stabmon.resources import Resources
from stabmon.rundir import DEFAULT_RUN_DIR, RunPaths
from stabmon.stall_action import StallResponder
from stabmon.throughput import ThroughputWatch, build_throughput

__all__ = ["Parts", "announce", "build", "serve", "start_threads"]


@dataclass(eq=False)
class Parts:
    """What the Monitor's hooks and public methods use (none of it refers to the Monitor)."""

    readings: Readings
    paths: RunPaths
    recorder: Recorder
    measurements: Measurements
    plugged: Plugged
    placement: PlacementWatch | None
    memory: MemorySampler
    device_timer: DeviceTimer | None
    devices: tuple[torch.device, ...]
    workers: WorkerWatch
    heartbeat: Heartbeat
    timer: LoopTimer
    throughput: ThroughputWatch
    registry: CollectorRegistry


def build(
    config: Config,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    run_id: str,
    rank: int,
    guard: Guard,
    limiter: LogLimiter,
    resources: Resources,
    clock: Callable[[], float],
) -> Parts:
    """The probes and their consumers, not yet running (no thread, no hook, no server)."""
    readings = Readings(
        labels={"rank": str(rank), "run": run_id}, build_info=build_info(__version__)
    )
    paths = RunPaths(
        root=Path(config.run_dir) if config.run_dir else DEFAULT_RUN_DIR, run_id=run_id, rank=rank
    )
    if config.event_log:
        resources.events = EventLog(paths.events, common={"run": run_id, "rank": rank}, guard=guard)
    recorder = Recorder(config, readings, events=resources.events, limiter=limiter)
    placement: PlacementWatch | None = None
    if config.device_check != "off":
        named = list(unwrap_model(model).named_parameters())
        placement = PlacementWatch(
            config.device_check, named, functools.partial(report_misplaced, recorder)
        )
    host: HostMemory | None = None
    with guard.contain("memory"):
        host = HostMemory()
    heartbeat = Heartbeat(clock)
    loop_started = clock()  # at or before the loop timer's first mark
    plugged = Plugged(guard)
    measurements = Measurements(
        model, optimizer, config, readings=readings, recorder=recorder, plugged=plugged,
        guard=guard, limiter=limiter,
    )  # fmt: skip
    probe = measurements.probe
    devices = cuda_devices(probe.params) if probe else ()
    memory = MemorySampler(readings, host, lambda: cuda_devices(probe.params) if probe else ())
    plugged.plug(
        Attachment(
            config=config, model=model, optimizer=optimizer, readings=readings,
            recorder=recorder, limiter=limiter, memory=memory, heartbeat=heartbeat,
            judging=measurements.engine, run_directory=paths.run_directory, rank=rank,
        )
    )  # fmt: skip
    device_timer = DeviceTimer(readings, record=recorder_for(devices[0])) if devices else None
    measurements.device_timer = device_timer
    timer = LoopTimer(
        readings, heartbeat, clock=clock, device_mark=device_timer.mark if device_timer else None
    )
    throughput = build_throughput(
        config.throughput, readings, model=unwrap_model(model), devices=devices,
        parameters=probe.params if probe else (), started=loop_started, recorder=recorder,
        limiter=limiter,
    )  # fmt: skip
    registry = _registry(readings, plugged, guard)
    return Parts(
        readings=readings, paths=paths, recorder=recorder, measurements=measurements,
        plugged=plugged, placement=placement, memory=memory, device_timer=device_timer,
        devices=devices, workers=WorkerWatch(recorder.worker_died), heartbeat=heartbeat,
        timer=timer, throughput=throughput, registry=registry,
    )  # fmt: skip


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


def serve(
    parts: Parts,
    config: Config,
    resources: Resources,
    *,
    guard: Guard,
    limiter: LogLimiter,
    local_rank: int,
    local_world_size: int,
) -> None:
    """Start the exporter (when ``serve_metrics``) on the first free candidate port."""
    if not config.serve_metrics:
        return
    ports = candidate_ports(config.port, local_rank, local_world_size, config.port_attempts)
    with guard.contain("exporter"):
        exporter = Exporter(
            parts.registry, address=config.address, ports=ports, limiter=limiter,
            security=Security.from_config(config), guard=guard,
            cache_seconds=config.scrape_cache_seconds,
        )  # fmt: skip
        if exporter.start():
            resources.exporter = exporter


def start_threads(
    parts: Parts,
    config: Config,
    resources: Resources,
    *,
    guard: Guard,
    run_id: str,
    rank: int,
    judge_quiet: Callable[[], None],
    clock: Callable[[], float],
) -> None:
    """Count collectives, then start the watchdog, stall responder and periodic threads.

    ``judge_quiet`` is the judge thread's task (it must hold the Monitor weakly).
    """
    watchdog, responder = _stall_watch(parts, config, resources, guard=guard, run_id=run_id,
                                       rank=rank, clock=clock)  # fmt: skip
    heartbeat, recorder, readings = parts.heartbeat, parts.recorder, parts.readings
    poll = min(0.25, config.stall_seconds / 4) if config.stall_seconds else 0.25
    every = config.sample_seconds
    threads = [
        PeriodicThread("stabmon-watchdog", poll, watchdog.check, guard=guard, component="stall"),
        PeriodicThread(
            "stabmon-stall-action", poll, responder.poll, guard=guard, component="stall"
        ),
        PeriodicThread(
            "stabmon-judge", QUIET_POLL_SECONDS, judge_quiet, guard=guard, component="readback"
        ),
        PeriodicThread(
            "stabmon-sampler", every, parts.memory.sample, guard=guard, component="memory"
        ),
        # The worker check holds the recorder, not the Monitor.
        PeriodicThread(
            "stabmon-loader", every, parts.workers.check, guard=guard, component="hooks"
        ),
    ]
    registration = resources.registration
    if registration is not None:

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

        threads.append(
            PeriodicThread("stabmon-heartbeat", every, beat, guard=guard, component="rundir")
        )
    resources.threads = threads
    with guard.contain("memory"):
        parts.memory.sample()
    for thread in threads:
        thread.start()


def _stall_watch(
    parts: Parts,
    config: Config,
    resources: Resources,
    *,
    guard: Guard,
    run_id: str,
    rank: int,
    clock: Callable[[], float],
) -> tuple[StallWatchdog, StallResponder]:
    """The stall watchdog, what it does about a stall, and the hang metrics it exposes."""
    collectives = CollectiveCounter()
    with guard.contain("hooks"):
        collectives.install()
        resources.collectives = collectives
    heartbeat = parts.heartbeat
    worker_stacks = resources.worker_stacks = WorkerStacks(parts.paths.run_directory, rank=rank)
    responder = StallResponder(
        action=config.stall_action, grace_seconds=config.stall_grace_seconds, rank=rank,
        run=run_id, recorder=parts.recorder, heartbeat=heartbeat, collectives=collectives,
        registration=resources.registration, run_directory=parts.paths.run_directory,
        root=parts.paths.root, worker_stacks=worker_stacks, workers=parts.workers,
        clock=clock,  # its grace period, node-records cache and flight-read interval
    )  # fmt: skip
    parts.registry.register(
        ContainedCollector(
            HangCollector(
                parts.readings.labels,
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
    parts: Parts,
    config: Config,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    guard: Guard,
    run_id: str,
    rank: int,
    metrics_url: str | None,
    event_log_path: Path | None,
) -> None:
    """The attach record (environment, config), the identity checks, the log line."""
    probe = parts.measurements.probe
    environment, gpus = describe_environment(parts.readings.build_info, parts.devices, guard)
    if gpus:
        parts.readings.device_info = gpus
    parts.recorder.write(
        "attach", environment=environment, config=config.to_dict(), pid=os.getpid(),
        metrics_url=metrics_url, parameters=len(probe.names) if probe else 0,
        module_groups=list(probe.groups) if probe else [],
    )  # fmt: skip
    check_local_rank(parts.recorder, guard)
    if parts.placement is not None:  # after the attach record, which opens the event log
        parts.placement.audit(unwrap_model(model), optimizer)  # raises only in raise mode
    LOGGER.info(
        "stabmon: attached (run %s, rank %d); metrics at %s; events in %s",
        run_id,
        rank,
        metrics_url or "(no exporter)",
        event_log_path or "(no event log)",
    )
