"""The Monitor: attach/detach lifecycle, and hooks that feed probes, readback and the recorder.

``Monitor`` holds no math and no judgement. Its hooks time the loop
(:class:`~stabmon.probes.timing.LoopTimer`), start device-side measurements
(:class:`~stabmon.probes.grads.GradProbe`) whose results come back through
:class:`~stabmon.readback.Readback`, and hand what comes back to the
:class:`~stabmon.recorder.Recorder`, which judges and records, in batches at most
``judge_seconds`` apart (the host-side work then runs warm). Every hook body
runs under the guard: nothing raised inside stabmon reaches the training loop.

When results are judged, and by which thread (the quiet-loop judge thread, the
exit hook), is :mod:`stabmon.judging`'s: its one re-entrant lock (``_judging``
here) serialises every use of the readback queue and of the judging code, three
uncontended acquisitions a step (four with a GradScaler).

Resources (hooks, threads, the HTTP server, the event log) live in one bundle
closed by ``detach()``, or by a finalizer if the Monitor is dropped without
it; nothing a thread or a hook holds refers back to the Monitor.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NamedTuple, TypeVar

import psutil
import torch
from prometheus_client import CollectorRegistry

from stabmon._version import __version__
from stabmon.background import PeriodicThread
from stabmon.clipping import watch_clipping
from stabmon.config import Config, load_config
from stabmon.contract import INTERNAL_COMPONENTS, PHASES
from stabmon.detectors.dead import DeadGradients
from stabmon.detectors.stall import STARTUP_PHASE, Heartbeat, StallWatchdog
from stabmon.errors import DeviceMismatchError, StabmonError
from stabmon.exit_signals import SigtermRecorder
from stabmon.export.collector import ReadingsCollector
from stabmon.export.contained import ContainedCollector
from stabmon.export.event_log import EventLog
from stabmon.export.exporter import Exporter, Security, candidate_ports
from stabmon.export.hang_collector import HangCollector
from stabmon.guard import Guard
from stabmon.hooks import HookSet, unwrap_model
from stabmon.judging import MAX_WAITING_RESULTS, QUIET_POLL_SECONDS, Judging
from stabmon.log import LOGGER, LogLimiter
from stabmon.probes.amp import scale_tensor
from stabmon.probes.collectives import CollectiveCounter
from stabmon.probes.device_timing import DeviceTimer, recorder_for
from stabmon.probes.environment import (
    build_info,
    default_run_id,
    environment_record,
    process_identity,
)
from stabmon.probes.grads import GradLayout, GradProbe, GradSummary, build_grad_probe
from stabmon.probes.identity import (
    identify_gpus,
    local_rank_problem,
    torch_device_uuids,
)
from stabmon.probes.loader import WorkerWatch, loader_problem
from stabmon.probes.memory import HostMemory, MemorySampler, cuda_devices
from stabmon.probes.memory_snapshot import SnapshotRecorder
from stabmon.probes.placement import Misplaced, PlacementWatch
from stabmon.probes.timing import LoopTimer, TrackedLoader, timed_iteration
from stabmon.probes.worker_stacks import WorkerStacks
from stabmon.readback import Readback
from stabmon.readings import Readings
from stabmon.recorder import Recorder
from stabmon.rundir import (
    DEFAULT_RUN_DIR,
    ExitWatch,
    ProcessRecord,
    Registration,
    RunPaths,
    boot_id,
    pid_namespace,
)
from stabmon.stall_action import StallResponder
from stabmon.throughput import ThroughputWatch

__all__ = ["Monitor", "attach"]

T = TypeVar("T")

#: Named phases beyond this many share the label "other" (bounded cardinality).
MAX_NAMED_PHASES = 16
_PHASE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_RESERVED_PHASES = frozenset((*PHASES, STARTUP_PHASE))
#: The longest ``detach()`` takes: the last judgement, then every thread and the server.
DETACH_SECONDS = 3.0
#: All threads together get this long to stop (however many hang), within DETACH_SECONDS.
SHUTDOWN_SECONDS = 1.0
#: However long the last judgement took, the threads get at least this long to stop.
MIN_SHUTDOWN_SECONDS = 0.5
#: Builds a named tuple in C, without the Python ``__new__`` that NamedTuple generates.
_tuple_new = tuple.__new__


# Named tuples, not frozen dataclasses: one is built per measured step.
class _GradTag(NamedTuple):
    """Built with ``_tuple_new`` on the hot path (see :class:`~stabmon.probes.grads.GradSample`).

    It carries the layout the step was measured with, which reads the values even when
    the probe was rebuilt while they waited (a new param group, a model moved or cast),
    and no tensor: results wait to be judged in batches, and a tensor would wait with them.
    """

    step: int
    layout: GradLayout


class _ValueTag(NamedTuple):
    """Built with ``_tuple_new`` on the hot path (see :class:`~stabmon.probes.grads.GradSample`)."""

    kind: Literal["loss", "scale", "clip"]
    step: int


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scaler: object | None = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
    **overrides: Any,
) -> Monitor:
    """Attach a Monitor to ``model`` and ``optimizer`` and start exporting.

    ``config`` is a YAML path or a mapping; ``overrides`` are config keys
    (``port=0``, ``stall_seconds=5``). Raises :class:`~stabmon.ConfigError` for
    bad config, :class:`~stabmon.AlreadyAttachedError` when either object
    already has a Monitor, and :class:`~stabmon.StabmonError` when the hooks
    cannot be installed; nothing else, and never after it returned.

    Example::

        mon = stabmon.attach(model, optimizer)
        for batch in mon.track(loader):
            loss = model(batch).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            mon.observe(loss=loss)
        mon.detach()
    """
    return Monitor(model, optimizer, scaler=scaler, config=config, **overrides)


@dataclass
class _Resources:
    """Everything that outlives a call: closed once, by ``detach()`` or by garbage collection."""

    hooks: HookSet | None = None
    threads: list[PeriodicThread] = field(default_factory=list)
    exporter: Exporter | None = None
    events: EventLog | None = None
    registration: Registration | None = None
    at_exit: Callable[[], None] | None = None
    #: Writes "signal"/SIGTERM into the record when SIGTERM ends the process (None: not ours).
    sigterm: SigtermRecorder | None = None
    #: At interpreter exit, judge the results still waiting: the last steps before a crash
    #: are the ones that explain it.
    judge_at_exit: Callable[[], None] | None = None
    #: The torch.distributed wrappers that count collectives (hang evidence).
    collectives: CollectiveCounter | None = None
    #: The chained ``worker_init_fn`` of tracked loaders (worker stacks on a stall).
    worker_stacks: WorkerStacks | None = None

    def close(self, deadline: float | None = None) -> None:
        """Release everything; threads are waited for until ``deadline`` (``time.monotonic``).

        Every thread is asked to stop first and then joined against the one deadline, so
        closing costs the slowest thread's stop, not the sum of them, and never more than
        ``SHUTDOWN_SECONDS`` however many threads hang.
        """
        if deadline is None:
            deadline = time.monotonic() + SHUTDOWN_SECONDS
        for hook in (self.at_exit, self.judge_at_exit):
            if hook is not None:
                atexit.unregister(hook)
        if self.sigterm is not None:
            self.sigterm.uninstall()
            self.sigterm = None
        if self.hooks is not None:
            self.hooks.remove()
        if self.collectives is not None:
            self.collectives.uninstall()
        if self.worker_stacks is not None:
            self.worker_stacks.uninstall()
        for thread in self.threads:
            thread.request_stop()
        if self.registration is not None:
            try:
                self.registration.remove()
            except OSError:
                pass  # the daemon reports a record whose process is gone as down
        if self.exporter is not None:
            try:
                self.exporter.stop(deadline - time.monotonic())
            except OSError:
                pass  # the socket is gone either way
        for thread in self.threads:
            thread.join(deadline - time.monotonic())
        if self.events is not None:
            self.events.close()


class Monitor:
    """Watches one model and optimizer; see :func:`attach`. Also a context manager."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: object | None = None,
        config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
        **overrides: Any,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise StabmonError(
                f"attach() needs the torch.optim.Optimizer whose step() ends each training "
                f"step, got {type(optimizer).__name__}. A loop that updates parameters by hand "
                "can pass torch.optim.SGD(model.parameters(), lr=0.0) and call its step() after "
                "each update (lr=0 changes nothing); stabmon measures the gradients there"
            )
        self.config: Config = load_config(config, overrides)
        identity = process_identity(os.environ)
        self.run_id: str = self.config.run_id or default_run_id(os.environ)
        self.rank: int = identity.rank
        self._limiter = LogLimiter(LOGGER, per_minute=self.config.log_rate_per_minute)
        self._guard = Guard(self._limiter, INTERNAL_COMPONENTS)
        self._resources = _Resources(hooks=HookSet(model, optimizer, scaler))
        self._finalizer = weakref.finalize(self, self._resources.close)
        # At interpreter exit the atexit hook records how the run ended; removing the
        # record then would make a crash look like a clean detach.
        self._finalizer.atexit = False
        self._detached = False
        try:
            self._start(model, optimizer, scaler, identity.local_rank, identity.local_world_size)
        except BaseException:
            self._finalizer()  # undo whatever was started; the model is left as it was
            raise

    def _start(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: object | None,
        local_rank: int,
        local_world_size: int,
    ) -> None:
        cfg = self.config
        self._local_rank = local_rank
        self._optimizer = optimizer
        self._model = model
        self._readings = Readings(
            labels={"rank": str(self.rank), "run": self.run_id},
            build_info=build_info(__version__),
        )
        self._paths = RunPaths(
            root=Path(cfg.run_dir) if cfg.run_dir else DEFAULT_RUN_DIR,
            run_id=self.run_id,
            rank=self.rank,
        )
        if cfg.event_log:
            self._resources.events = EventLog(
                self._paths.events,
                common={"run": self.run_id, "rank": self.rank},
                guard=self._guard,
            )
        self._recorder = Recorder(
            cfg, self._readings, events=self._resources.events, limiter=self._limiter
        )
        self._sampler = self._recorder.sampler
        # Results are judged in batches, at most judge_seconds apart on the loop clock: the
        # host-side work then runs with warm caches (bench/overhead.py measures the saving
        # against judge_seconds 0 on its tiny MLP). The first result is judged at once.
        self._engine: Judging[_GradTag | _ValueTag] = Judging(
            self._consume, guard=self._guard, judge_seconds=cfg.judge_seconds
        )
        self._pid = os.getpid()  # a forked child inherits the Monitor, not the run
        self._grads: GradProbe | None = None
        self._snapshots = SnapshotRecorder(
            cfg.memory_snapshot_steps, self._paths.run_directory, self.rank
        )
        self._dead: DeadGradients | None = None
        self._dead_layout: GradLayout | None = None  # the layout self._dead was built for
        self._param_signature = _param_signature(optimizer)
        self._measure_every = cfg.measure_every
        self._window_steps = cfg.window_steps
        self._leak_sample_steps = cfg.leak_sample_steps
        self._leak_warmup_steps = cfg.leak_trend_warmup_steps
        # A measurement taken by a clip call before the step it belongs to (pre-clip norms):
        # (steps completed when taken, sample, layout), used by that step's pre-hook.
        self._preclip: tuple[int, Any, GradLayout] | None = None
        # Lightning measures at on_before_optimizer_step, before it clips: its clip belongs
        # to the step just measured (set by the adapter through _clips_after_measuring()).
        self._clip_after_measure = False
        with self._guard.contain("grads"):
            self._grads = _build_grad_probe(model, optimizer, cfg, self._limiter)
        self._placement: PlacementWatch | None = None
        if cfg.device_check != "off":
            named = list(unwrap_model(model).named_parameters())
            self._placement = PlacementWatch(cfg.device_check, named, self._report_misplaced)
        self._state_audited = False
        self._scaler = scaler
        self._steps_at_update = 0
        self._scaler_seen = False
        if scaler is not None:
            self._readings.amp_skipped_steps = 0

        host: HostMemory | None = None
        with self._guard.contain("memory"):
            host = HostMemory()
        probe = self._grads
        self._memory = MemorySampler(
            self._readings, host, lambda: cuda_devices(probe.params) if probe else ()
        )
        devices = cuda_devices(probe.params) if probe else ()
        self._device_timer = (
            DeviceTimer(self._readings, record=recorder_for(devices[0])) if devices else None
        )
        self._workers = WorkerWatch(self._recorder.worker_died)
        # One clock for the loop timer, the heartbeat and the watchdog: the timer's reading at
        # a step's end is the beat.
        self._heartbeat = Heartbeat(time.perf_counter)
        loop_started = time.perf_counter()  # at or before the loop timer's first mark
        self._timer = LoopTimer(
            self._readings,
            self._heartbeat,
            clock=time.perf_counter,
            device_mark=self._device_timer.mark if self._device_timer else None,
        )
        self._device_type = "cuda" if devices else "cpu"
        self._throughput = _build_throughput(self, devices, probe, loop_started)
        self._user_marks_epochs = False
        self._loader_marks_epochs = False
        self._loader_closed_at: int | None = None
        self._named_phases: set[str] = set()
        # Decided at the first observe() when no forward hook fires (a compiled forward).
        self._observes_before_step: bool | None = None

        registry = CollectorRegistry(auto_describe=False)
        registry.register(ReadingsCollector(self._readings, self._guard.counts))
        self._registry = registry
        if cfg.serve_metrics:
            ports = candidate_ports(cfg.port, local_rank, local_world_size, cfg.port_attempts)
            with self._guard.contain("exporter"):
                exporter = Exporter(
                    registry, address=cfg.address, ports=ports, limiter=self._limiter,
                    security=Security.from_config(cfg), guard=self._guard,
                    cache_seconds=cfg.scrape_cache_seconds,
                )  # fmt: skip
                if exporter.start():
                    self._resources.exporter = exporter

        self._register(probe)
        # After _register's exit hook: atexit runs them last in, first out, so the waiting
        # results are judged before the record says how the process ended.
        self._resources.judge_at_exit = functools.partial(_judge_at_exit, weakref.ref(self))
        atexit.register(self._resources.judge_at_exit)
        worker_stacks = self._resources.worker_stacks = WorkerStacks(
            self._paths.run_directory, rank=self.rank
        )
        collectives = CollectiveCounter()
        with self._guard.contain("hooks"):
            collectives.install()
            self._resources.collectives = collectives
        responder = StallResponder(
            action=cfg.stall_action, grace_seconds=cfg.stall_grace_seconds, rank=self.rank,
            run=self.run_id, recorder=self._recorder, heartbeat=self._heartbeat,
            collectives=collectives, registration=self._resources.registration,
            run_directory=self._paths.run_directory, root=self._paths.root,
            worker_stacks=worker_stacks, workers=self._workers,
        )  # fmt: skip
        heartbeat_now = self._heartbeat
        registry.register(
            ContainedCollector(
                HangCollector(
                    self._readings.labels,
                    phase=lambda: heartbeat_now.phase,
                    collectives=lambda: collectives.issued,
                    in_collective=lambda: collectives.current is not None,
                    hang_state=lambda: responder.state,
                ),
                guard=self._guard,
                component="exporter",
            )
        )
        watchdog = StallWatchdog(
            self._heartbeat,
            stall_seconds=cfg.stall_seconds,
            phase_stall_seconds=cfg.phase_stall_seconds,
            on_stall=responder.stalled,
            on_recover=responder.resumed,
            clock=time.perf_counter,
            peer_in_phase=responder.peer_in_phase,
        )
        poll = min(0.25, cfg.stall_seconds / 4) if cfg.stall_seconds else 0.25
        self._resources.threads = [
            PeriodicThread(
                "stabmon-watchdog", poll, watchdog.check, guard=self._guard, component="stall"
            ),
            PeriodicThread(
                "stabmon-stall-action", poll, responder.poll, guard=self._guard, component="stall"
            ),
            PeriodicThread(
                "stabmon-judge",
                QUIET_POLL_SECONDS,
                functools.partial(_judge_if_quiet, weakref.ref(self)),
                guard=self._guard,
                component="readback",
            ),
            PeriodicThread(
                "stabmon-sampler",
                cfg.sample_seconds,
                self._memory.sample,
                guard=self._guard,
                component="memory",
            ),
            PeriodicThread(
                "stabmon-loader",
                cfg.sample_seconds,
                self._workers.check,  # holds the recorder, not the Monitor
                guard=self._guard,
                component="hooks",
            ),
        ]
        registration = self._resources.registration
        if registration is not None:
            readings, recorder = self._readings, self._recorder
            heartbeat_state = self._heartbeat

            def heartbeat() -> None:  # captures no Monitor: a dropped Monitor can be collected
                registration.write(
                    last_step_unix=readings.last_step_unix,
                    steps=recorder.global_step,
                    now=time.time(),
                    phase=heartbeat_state.phase,
                    stall_limit_seconds=watchdog.limit_seconds(),
                )

            self._resources.threads.append(
                PeriodicThread(
                    "stabmon-heartbeat",
                    cfg.sample_seconds,
                    heartbeat,
                    guard=self._guard,
                    component="rundir",
                )
            )
        with self._guard.contain("memory"):
            self._memory.sample()
        for thread in self._resources.threads:
            thread.start()

        assert self._resources.hooks is not None  # set in __init__ before _start
        try:
            self._resources.hooks.install(
                forward_pre=self._on_forward_pre,
                forward_post=self._on_forward_post,
                step_pre=self._on_step_pre,
                step_post=self._on_step_post,
                scaler_update=self._on_scaler_update if scaler is not None else None,
            )
        except RuntimeError as error:  # e.g. a TorchScript module, which takes no Python hooks
            raise StabmonError(
                f"cannot install hooks on {type(model).__name__}: {error}; attach to the "
                "Python nn.Module before scripting it"
            ) from error
        with self._guard.contain("hooks"):
            # Held weakly by the clip wrappers; removed with the hooks.
            this = weakref.ref(self)
            self._resources.hooks.keep(
                watch_clipping(
                    functools.partial(_owns_param, this), functools.partial(_clip_seen, this)
                )
            )
        environment = self._describe_environment(probe)
        self._recorder.write(
            "attach",
            environment=environment,
            config=cfg.to_dict(),
            pid=os.getpid(),
            metrics_url=self.metrics_url,
            parameters=len(probe.names) if probe else 0,
            module_groups=list(probe.groups) if probe else [],
        )
        self._check_local_rank()
        if self._placement is not None:  # after the attach record, which opens the event log
            self._placement.audit(unwrap_model(model), optimizer)  # raises only in raise mode
        LOGGER.info(
            "stabmon: attached (run %s, rank %d); metrics at %s; events in %s",
            self.run_id,
            self.rank,
            self.metrics_url or "(no exporter)",
            self.event_log_path or "(no event log)",
        )

    def _describe_environment(self, probe: GradProbe | None) -> dict[str, Any]:
        """Identify the physical GPUs in use and record the environment (never raises)."""
        gpus: list[dict[str, str]] = []
        driver = ""
        with self._guard.contain("hooks"):
            devices = cuda_devices(probe.params) if probe else ()
            if devices:
                driver, identities = identify_gpus(devices)
                gpus = [{**identity.labels(), "driver_version": driver} for identity in identities]
                self._readings.device_info = gpus
        return environment_record(self._readings.build_info, gpus, driver, os.environ)

    def _check_local_rank(self) -> None:
        """cuda:LOCAL_RANK must exist: say so in words, not as "invalid device ordinal"."""
        with self._guard.contain("hooks"):
            if torch.cuda.is_available():
                problem = local_rank_problem(os.environ, torch.cuda.device_count())
                if problem is not None:
                    self._recorder.anomaly("device_mismatch", 0, problem, what="LOCAL_RANK")

    def _report_misplaced(self, finding: Misplaced) -> None:
        self._recorder.anomaly(
            "device_mismatch",
            self._recorder.global_step,
            f"{finding.message()} (device_check: raise makes this an error)",
            what=finding.what,
            device=finding.device,
            expected=finding.expected,
            names=list(finding.names[:20]),
        )

    def _register(self, probe: GradProbe | None) -> None:
        """Register this process in the run directory for the node daemon (never raises).

        A first write that fails (say the run directory is not yet writable) is
        retried by the heartbeat thread; at interpreter exit the record says
        whether the run ended cleanly or on an uncaught exception.
        """
        with self._guard.contain("rundir"):
            devices = cuda_devices(probe.params) if probe else ()
            registration = Registration(
                self._paths.root,
                self._paths.record,
                ProcessRecord(
                    pid=os.getpid(),
                    create_time=psutil.Process().create_time(),
                    run=self.run_id,
                    rank=self.rank,
                    local_rank=self._local_rank,
                    hostname=socket.gethostname(),
                    gpu_uuids=tuple(torch_device_uuids(devices)),
                    cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                    metrics_url=self.metrics_url,
                    attached_unix=time.time(),
                    stall_seconds=self.config.stall_seconds,
                    boot_id=boot_id(),
                    pid_namespace=pid_namespace(),
                ),
                # A weak reference: the record outlives a Monitor dropped without detach.
                on_duplicate=functools.partial(_report_duplicate, weakref.ref(self)),
            )
            self._resources.registration = registration
            ExitWatch.install()
            self._resources.at_exit = functools.partial(_record_exit, weakref.ref(registration))
            atexit.register(self._resources.at_exit)
            self._resources.sigterm = SigtermRecorder.install(
                functools.partial(_record_sigterm, weakref.ref(registration))
            )
            registration.write(
                last_step_unix=None, steps=self._recorder.global_step, now=time.time()
            )

    def _report_duplicate(self, other: ProcessRecord) -> None:
        """Another live process already registered this run id and rank: say so, count it."""
        self._guard.count("rundir")
        self._limiter.once(
            "rundir:duplicate",
            logging.WARNING,
            "stabmon: process %d already registered run %r rank %d in %s; this process (%d) "
            "takes its record over and both append to one event log. Give each run its own "
            "run_id (or STABMON_RUN_ID), or each process its own RANK",
            other.pid,
            self.run_id,
            self.rank,
            self._paths.record,
            os.getpid(),
        )

    # --- public API ---------------------------------------------------------------------------

    @property
    def metrics_url(self) -> str | None:
        """The scrape URL of this Monitor's exporter, or None when it is not serving."""
        exporter = self._resources.exporter
        return exporter.url if exporter is not None and not self._detached else None

    @property
    def event_log_path(self) -> Path | None:
        """The JSON-lines event log of this process, or None when it is off or unwritable."""
        events = self._resources.events
        return events.path if events is not None and events.enabled else None

    @property
    def registry(self) -> CollectorRegistry:
        """The Monitor's own registry (no global state), e.g. for ``generate_latest``."""
        return self._registry

    def observe(
        self,
        loss: torch.Tensor | float | None = None,
        *,
        samples: int | None = None,
        tokens: int | None = None,
    ) -> None:
        """Record this step's training loss: a tensor (kept on device, read later) or a float.

        Losses observed inside a named phase (``with mon.phase("eval")``) are
        evaluation losses and are left out of the training loss series.
        ``samples`` and ``tokens`` (Python ints) add to ``stabmon_samples_total`` and
        ``stabmon_tokens_total``; once given, ``track()`` no longer counts batches.
        """
        if (samples is not None or tokens is not None) and not self._detached:
            with self._guard.contain("hooks"):
                self._throughput.observed(samples, tokens)
        timer = self._timer
        if loss is None or self._detached or timer.in_named_phase:
            return
        try:
            step = self._recorder.global_step
            in_iteration = timer.in_iteration
            if not timer.forward_seen:
                # Hooks inside a compiled forward never fire: a loop that observes before its
                # optimizer step makes its first observe() before the first step.
                if self._observes_before_step is None:
                    self._observes_before_step = self._readings.steps == 0
                in_iteration = self._observes_before_step
            if not in_iteration and step:
                step -= 1  # observed after the step it belongs to
            tag = _tuple_new(_ValueTag, ("loss", step))
            if isinstance(loss, torch.Tensor):
                if loss.is_complex():
                    raise TypeError(
                        "observe() got a complex-valued loss; pass a real loss (its real part or "
                        "abs()); complex losses are skipped"
                    )
                value = loss if loss.numel() == 1 else loss.detach().float().mean()
                if value.is_cpu:  # host memory: no device to wait for
                    host: torch.Tensor | list[float] = [value.item()]
                else:
                    host = value.detach().reshape(1).double()
            else:
                host = [float(loss)]  # through the queue too (a complex raises here: skipped)
            with self._judging:
                waiting = self._readback.submit(tag, host)
                if not self._judge_seconds or waiting >= MAX_WAITING_RESULTS:
                    # judge_seconds 0: each result once it is on the host. Or many losses
                    # came without a step end (hooks that do not fire): they wait no longer.
                    self._consume(self._readback.poll())
        except Exception as error:  # never break training
            self._guard.record("loss", error)

    def epoch_end(self) -> None:
        """Mark an epoch boundary: sample memory, judge drift and leaks, log a summary.

        Once called, explicit calls alone mark epochs (``track()`` no longer does).
        """
        if self._detached:
            return
        self._user_marks_epochs = True
        if self._loader_closed_at == self._readings.steps:
            return  # track() closed this very epoch a moment ago: the same boundary, once
        self._close_epoch()

    def track(self, loader: Iterable[T]) -> TrackedLoader[T]:
        """Iterate ``loader``, timing the input wait; its exhaustion marks an epoch end.

        A pass in which no optimizer step happened (a validation loader) marks
        no epoch, and neither does any pass once ``epoch_end()`` is called. The
        result keeps the loader's ``len()`` and attributes (``.dataset``, ``.sampler``).
        """
        self._timer.track_loader()
        self._loader_marks_epochs = True
        with self._guard.contain("hooks"):
            problem = loader_problem(loader)
            if problem is not None:
                self._limiter.once("loader:timeout", logging.WARNING, "stabmon: %s", problem)
            if self._resources.worker_stacks is not None:
                self._resources.worker_stacks.install(loader)
        return TrackedLoader(loader, functools.partial(self._timed_pass, loader))

    @contextlib.contextmanager
    def data_wait(self) -> Iterator[None]:
        """Time the block as input wait: for loops that fetch batches with a function.

        Example (a GPT-style loop without a DataLoader)::

            with mon.data_wait():
                x, y = get_batch("train")

        A fetch in the middle of an iteration (the next micro-batch, fetched between
        forward and backward) is taken out of that phase and booked as ``data_wait``.
        """
        timer = self._timer
        timer.track_loader()  # from now on input wait is what these blocks time
        start = timer.clock()
        try:
            yield
        finally:
            self._loader_wait(timer.clock() - start)

    def _timed_pass(self, loader: Iterable[T]) -> Iterator[T]:
        """One timed pass over ``loader`` (each ``iter()`` of what ``track()`` returned)."""
        steps_at_start = self._readings.steps

        def exhausted() -> None:
            if not self._user_marks_epochs and self._readings.steps > steps_at_start:
                self._close_epoch()
                self._loader_closed_at = self._readings.steps

        workers = self._workers
        guard = self._guard

        def failed(error: BaseException) -> None:
            with guard.contain("hooks"):
                workers.failed(error)

        return self._throughput.counted(
            timed_iteration(
                loader, self._loader_wait, exhausted, on_iterator=workers.follow, on_error=failed
            )
        )

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the time inside the block to the named phase (``eval``, ``checkpoint``).

        Inside it, the stall limit is ``phase_stall_seconds``, forward hooks are
        not timed as training, and observed losses are not training losses.
        """
        label = self._phase_label(name)
        # A phase may take long (eval, checkpoint): what is on the host is judged before it,
        # copies still in flight by the judge thread during it (no step ends), or after it.
        # The device timer is left to the step ends, which poll it anyway.
        self._judge_waiting()
        with self._guard.contain("hooks"):
            self._throughput.abandon(self._readings.steps)  # an eval is not the step's FLOPs
            self._timer.enter_named(label)
        try:
            yield
        finally:
            with self._guard.contain("hooks"):
                self._timer.exit_named()
            self._judge_waiting()

    def mark_forward(self) -> None:
        """A training step's forward pass begins now; the time before it was input wait.

        The model's own forward hooks mark this when the loop calls ``model(...)``. For
        trainers that run the step through another method of the model (Lightning's
        ``training_step`` calling submodules), the adapter marks it instead.
        """
        if self._detached or not torch.is_grad_enabled():
            return
        with self._guard.contain("hooks"):
            self._timer.forward_start()

    def mark_backward(self) -> None:
        """The backward pass begins now: the time since the forward began was the forward's.

        A no-op when the model's forward hooks have already ended the forward pass.
        """
        if self._detached:
            return
        with self._guard.contain("hooks"):
            if self._timer.phase == "forward":
                self._timer.forward_end()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must carry so a resumed run keeps its numbering and baselines.

        Results still in flight on the device (the last step's gradients and loss) are
        read first, waiting at most a second: a checkpoint is rare, and ``torch.save``
        waits for the device anyway.
        """
        self._judge_waiting(wait_seconds=1.0)
        state = self._recorder.state_dict()
        state["run_id"] = self.run_id
        state["epochs_marked_by"] = (
            "user"
            if self._user_marks_epochs
            else "loader"
            if self._loader_marks_epochs
            else "steps"
        )
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: step and epoch numbering, spike statistics, memory
        baselines. Counters restart at 0 in a new process, which Prometheus reads as a reset.

        Raises :class:`~stabmon.StabmonError` for a state that is not one, and changes nothing.
        """
        # Results of the steps before the resume are judged against the old baselines; copies
        # in flight get a second, as in state_dict().
        self._judge_waiting(wait_seconds=1.0)
        self._recorder.load_state_dict(state)
        with self._guard.contain("detectors"):
            self._throughput.restart(self._timer.clock())  # the first steps after a resume
        if state.get("epochs_marked_by") == "user":
            self._user_marks_epochs = True

    def detach(self) -> None:
        """Remove every hook, stop every thread and free the port; idempotent."""
        if self._detached:
            return
        deadline = time.monotonic() + DETACH_SECONDS  # one bound for the whole detach
        self._judge_last(wait_seconds=1.0)  # bounded: never hang a detach
        with self._guard.contain("detectors"):
            self._throughput.close()
            self._throughput.record(self._timer.clock())  # the totals goodput reads
        self._detached = True
        self._engine.closed = True
        self._recorder.write("detach", step=self._recorder.global_step, epoch=self._readings.epoch)
        if self._finalizer.detach() is not None:  # not yet closed (nor collected)
            now = time.monotonic()
            closing = min(deadline, now + SHUTDOWN_SECONDS)
            self._resources.close(max(closing, now + MIN_SHUTDOWN_SECONDS))

    def __enter__(self) -> Monitor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.detach()

    # --- hooks (training thread; each body contained) -----------------------------------------

    def _on_forward_pre(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        placement = self._placement
        if placement is not None:
            try:
                misplaced = placement.misplaced_inputs(args, kwargs)
                if misplaced:
                    placement.report_inputs(misplaced)
            except DeviceMismatchError:
                raise  # device_check: raise asked for it, before PyTorch's vaguer error
            except Exception as error:
                self._guard.record("hooks", error)
        if not torch.is_grad_enabled() or not module.training:
            # Evaluation or inference: not part of a training step, but progress.
            try:
                self._timer.eval_forward()
            except Exception as error:
                self._guard.record("hooks", error)
            return
        self._preclip = None  # new gradients are coming: a clip measured before is stale
        try:
            self._timer.forward_start()
            watch = self._throughput
            if self._readings.steps == watch.flops_step and not self._timer.in_named_phase:
                watch.forward_start(self._device_type)  # once: the step whose FLOPs are counted
            elif watch.counting:
                watch.forward_counted(self._readings.steps)
        except Exception as error:
            self._guard.record("hooks", error)

    def _on_forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or not module.training:
            return
        try:
            self._timer.forward_end()
        except Exception as error:
            self._guard.record("hooks", error)

    def _on_step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            if self._throughput.counting:
                self._throughput.optimizer_start()
            self._timer.optimizer_start()
        except Exception as error:
            self._guard.record("hooks", error)
        if not self._state_audited and self._placement is not None:
            # Once more at the first step: optimizer state loaded from a checkpoint after
            # attach exists only now.
            self._state_audited = True
            try:
                self._placement.audit(unwrap_model(self._model), optimizer)
            except DeviceMismatchError:
                raise
            except Exception as error:
                self._guard.record("hooks", error)
        if self._readings.steps % self._measure_every:
            return
        try:
            preclip = self._preclip
            if preclip is not None and preclip[0] == self._readings.steps:
                # Measured by this step's clip call, before clipping scaled the gradients.
                self._preclip = None
                sample, layout = preclip[1], preclip[2]
            else:
                probe = self._current_probe(optimizer)
                sample = probe.measure()
                layout = probe.layout  # measure() rebuilt it first if the model moved
            if sample is not None:
                tag = _tuple_new(_GradTag, (self._recorder.global_step, layout))
                with self._judging:
                    self._readback.submit(tag, sample.packed)
        except Exception as error:
            self._guard.record("grads", error)

    def _current_probe(self, optimizer: torch.optim.Optimizer) -> GradProbe:
        """The gradient probe, rebuilt when the optimizer's parameters changed
        (``add_param_group()``): the step pre-hook and the clip watch both measure with it."""
        groups = optimizer.param_groups
        count = 0
        for group in groups:  # _param_signature, inlined: this runs every measured step
            count += len(group["params"])
        probe = self._grads
        if (len(groups), count) != self._param_signature or probe is None:
            self._param_signature = (len(groups), count)  # add_param_group(): measure anew
            probe = self._grads = _build_grad_probe(
                self._model, optimizer, self.config, self._limiter
            )
        return probe

    def _on_clip(self, params: Any, max_norm: float) -> None:
        """A clip of our parameters is about to scale the gradients: measure them first.

        The measurement is the one the step pre-hook would take (moved earlier, same cost);
        ``max_norm`` goes to the recorder for the clip coefficient. Never a sync.
        """
        try:
            step = self._recorder.global_step
            if self._clip_after_measure:
                step = max(step - 1, 0)  # Lightning: the step was measured (and counted) already
            elif self._readings.steps % self._measure_every == 0:
                probe = self._current_probe(self._optimizer)
                sample = probe.measure()
                self._preclip = (
                    None if sample is None else (self._readings.steps, sample, probe.layout)
                )
            with self._judging:
                self._readback.submit(_tuple_new(_ValueTag, ("clip", step)), [max_norm])
        except Exception as error:
            self._guard.record("grads", error)

    def _clips_after_measuring(self) -> None:
        """For adapters that step the Monitor before the framework clips (Lightning)."""
        self._clip_after_measure = True

    def _on_step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        now = self._judged_at  # if the timer fails: collect, and judge at the next due step
        with self._judging:
            try:
                now = self._timer.optimizer_end()
                sampler = self._sampler
                ended = self._readings.steps + self._recorder.step_offset - 1  # global step
                if ended >= sampler.window_due:
                    if sampler.close_window(ended):  # many sample windows wait: judge them now
                        self._judged_at = -float("inf")
            except Exception as error:
                self._guard.record("hooks", error)
            self._poll(now)
        if now >= self._throughput.due:  # one comparison a step; a block every few seconds
            with self._guard.contain("detectors"):
                self._throughput.step_end(now)
        if self._snapshots.recording:
            self._finish_snapshot()
        if self._readings.steps % self._window_steps == 0 and not (
            self._user_marks_epochs or self._loader_marks_epochs
        ):
            self._close_epoch()
        steps = self._readings.steps
        if steps % self._leak_sample_steps == 0 and steps > self._leak_warmup_steps:
            self._sample_memory_trend()

    def _sample_memory_trend(self) -> None:
        """Every ``leak_sample_steps`` steps: memory for the trend leak rule (any loop shape)."""
        with self._guard.contain("memory"):
            samples = self._memory.trend_samples()
            with self._judging:
                self._recorder.memory_trend(
                    samples, self._memory.limits, self._heartbeat.median_step_seconds()
                )

    def _on_scaler_update(self) -> None:
        """After ``GradScaler.update()``: read the new scale; close a skipped iteration."""
        try:
            stepped = self._readings.steps != self._steps_at_update
            self._steps_at_update = self._readings.steps
            if not stepped:
                self._timer.iteration_skipped()  # the step hooks never ran
                self._preclip = None  # measured by a clip whose step was skipped
                self._throughput.abandon(self._readings.steps)
            step = self._recorder.global_step - (1 if stepped else 0)
            scale = scale_tensor(self._scaler)
            with self._judging:
                if scale is not None:
                    self._readback.submit(_ValueTag("scale", max(step, 0)), scale)
                self._poll(self._timer.clock())  # a skipped step has no step end to poll at
        except Exception as error:
            self._guard.record("hooks", error)

    def _loader_wait(self, seconds: float) -> None:
        try:
            self._timer.loader_wait(seconds)
        except Exception as error:
            self._guard.record("hooks", error)

    # --- host side ----------------------------------------------------------------------------

    def _poll(self, now: float) -> None:
        """Collect finished reads every step; judge them once ``judge_seconds`` have passed.

        The caller holds ``_judging``.
        """
        try:
            waiting = self._readback.collect()
            if waiting and (
                now - self._judged_at >= self._judge_seconds or waiting >= MAX_WAITING_RESULTS
            ):
                self._judged_at = now
                self._consume(self._readback.poll())
            if self._device_timer is not None:
                self._device_timer.poll()
        except Exception as error:
            self._guard.record("readback", error)

    # --- the judging engine (stabmon.judging), under the names the hooks use ----------------

    @property
    def _readback(self) -> Readback[_GradTag | _ValueTag]:
        return self._engine.readback

    @property
    def _judging(self) -> threading.RLock:
        return self._engine.lock

    @property
    def _judge_seconds(self) -> float:
        return self._engine.judge_seconds

    @property
    def _judged_at(self) -> float:
        return self._engine.judged_at

    @_judged_at.setter
    def _judged_at(self, value: float) -> None:
        self._engine.judged_at = value

    def _reentered(self) -> bool:
        return self._engine.reentered()

    def _judge_waiting(self, wait_seconds: float = 0.0) -> None:
        self._engine.judge_waiting(wait_seconds)

    def _judge_last(self, wait_seconds: float) -> None:
        self._engine.judge_last(wait_seconds, self._finish_judging)

    def _finish_judging(self) -> None:
        """The device timer's last events and the step sample still waiting for a value."""
        if self._device_timer is not None:
            self._device_timer.poll()
        self._recorder.flush_sample()

    def _judge_quiet(self) -> None:
        """Judge thread: judge what waits in a quiet loop (see stabmon.judging). The device
        timer is left to the training thread, whose hooks record its events."""
        median = self._heartbeat.median_step_seconds()
        self._engine.judge_quiet(self._timer.clock(), self._heartbeat.last_beat, median)

    def _consume(self, results: list[tuple[_GradTag | _ValueTag, list[float]]]) -> None:
        for tag, values in results:
            try:  # per result, so one bad value does not lose the others
                if isinstance(tag, _GradTag):
                    layout = tag.layout  # the one it was measured with, however old
                    summary = layout.summarize(values)
                    self._recorder.grads(tag.step, summary, layout.nonfinite_offenders)
                    self._judge_dead(tag.step, summary)
                elif tag.kind == "loss":
                    self._recorder.loss(tag.step, values[0])
                elif tag.kind == "clip":
                    self._recorder.clip(tag.step, values[0])
                else:
                    self._recorder.scale(tag.step, values[0])
            except Exception as error:
                self._guard.record("detectors", error)

    def _judge_dead(self, step: int, summary: GradSummary) -> None:
        """Feed the dead-branch detector; a new layout (model moved, params changed) restarts it."""
        layout = summary.layout
        empty_shards = layout.empty_shards
        dead = self._dead
        if dead is None or self._dead_layout is not layout:
            empty = set(empty_shards)
            names = [n for i, n in enumerate(layout.names) if i not in empty]
            groups = [g for i, g in enumerate(layout.packed_groups) if i not in empty]
            dead = self._dead = DeadGradients(names, groups, self.config.dead_grad_steps)
            self._dead_layout = layout
        norms = summary.tensor_norms
        if empty_shards:
            empty = set(empty_shards)
            norms = [n for i, n in enumerate(norms) if i not in empty]
        report = dead.update(norms, summary.zero_grad_params)
        if report.newly_dead or report.revived or not self._readings.dead_grad_params:
            self._recorder.dead(step, report, dead.dead_by_group())

    def _close_epoch(self) -> None:
        self._judge_waiting()
        with self._guard.contain("memory"):
            samples, peaks = self._memory.epoch_samples()
            self._recorder.epoch(samples, peaks)
            self._start_snapshot()
            if self._grads is not None and self._grads.trainable_changed():
                self._grads = _build_grad_probe(
                    self._model, self._optimizer, self.config, self._limiter
                )

    def _start_snapshot(self) -> None:
        """When the leak rule holds on a CUDA device, record its allocator (if configured)."""
        step = self._recorder.global_step
        for label, suspected in self._readings.memory_leak_suspected.items():
            if suspected and label.startswith("cuda") and self._snapshots.start(label, step):
                self._recorder.write(
                    "memory_snapshot_started",
                    device=label,
                    step=step,
                    steps=self.config.memory_snapshot_steps,
                )
                return

    def _finish_snapshot(self) -> None:
        with self._guard.contain("memory"):
            finished = self._snapshots.step(self._recorder.global_step)
            if finished is not None:
                device, path = finished
                self._recorder.write(
                    "memory_snapshot", device=device, step=self._recorder.global_step,
                    path=str(path),
                )  # fmt: skip
                LOGGER.warning(
                    "stabmon: CUDA allocator snapshot of %s written to %s; open it at "
                    "https://pytorch.org/memory_viz to see which allocations grow",
                    device,
                    path,
                )

    def _phase_label(self, name: str) -> str:
        if isinstance(name, str) and name in self._named_phases:
            return name
        problem = None
        if not isinstance(name, str) or not _PHASE_NAME.match(name):
            problem = "is not a short identifier ([A-Za-z_][A-Za-z0-9_]*, at most 64 characters)"
        elif name in _RESERVED_PHASES:
            problem = "is a built-in loop phase"
        elif len(self._named_phases) >= MAX_NAMED_PHASES:
            problem = f"would be phase name number {MAX_NAMED_PHASES + 1}"
        if problem is not None:
            self._limiter.once(
                "phase-name",
                logging.WARNING,
                "stabmon: phase name %r %s; its time is counted as phase 'other' (logged once)",
                name,
                problem,
            )
            return "other"
        self._named_phases.add(name)
        return name


def _judge_if_quiet(monitor: weakref.ref[Monitor]) -> None:
    """The judge thread's task; holds the Monitor weakly, like every thread."""
    target = monitor()
    if target is not None:
        target._judge_quiet()


def _judge_at_exit(monitor: weakref.ref[Monitor]) -> None:
    """atexit: judge the results still waiting, so an anomaly just before a crash is recorded.

    Copies still in flight on a device get half a second, as at detach (bounded: the
    device may be what failed), and the last step sample is written; the judge thread
    judges nothing after this. A forked child inherits the Monitor but not the run: it
    leaves the parent's results alone.
    """
    target = monitor()
    if target is None or target._detached or target._pid != os.getpid():
        return
    target._engine.exiting = True
    target._judge_last(wait_seconds=0.5)


def _report_duplicate(monitor: weakref.ref[Monitor], other: ProcessRecord) -> None:
    alive = monitor()
    if alive is not None:
        alive._report_duplicate(other)


def _record_exit(registration: weakref.ref[Registration]) -> None:
    """atexit: mark the record "clean" or "exception" so the daemon can tell a crash from an end."""
    target = registration()
    if target is not None:
        try:
            target.exited(ExitWatch.status(), time.time(), signal_name=ExitWatch.signal_name())
        except OSError:
            pass  # the daemon then sees a process that vanished: reported as down


def _record_sigterm(registration: weakref.ref[Registration]) -> None:
    """SIGTERM is ending the process: say so in the record, so no one is paged for a crash."""
    target = registration()
    if target is not None:
        target.exited("signal", time.time(), signal_name="SIGTERM")


def _owns_param(monitor: weakref.ref[Monitor], param: torch.Tensor) -> bool:
    """Whether ``param`` is measured by the Monitor (held weakly by the clip wrappers)."""
    target = monitor()
    probe = None if target is None or target._detached else target._grads
    return probe is not None and probe.owns(param)


def _clip_seen(monitor: weakref.ref[Monitor], params: Any, max_norm: float) -> None:
    target = monitor()
    if target is not None:
        target._on_clip(params, max_norm)


def _build_throughput(
    monitor: Monitor, devices: tuple[torch.device, ...], probe: GradProbe | None, started: float
) -> ThroughputWatch:
    """Throughput and slowdown accounting; MFU only where a CUDA device's peak is known."""
    device_name = None
    if devices:
        try:
            device_name = torch.cuda.get_device_name(devices[0])
        except (AssertionError, RuntimeError):
            device_name = ""  # a GPU without properties: in no table, so no MFU
    recorder = monitor._recorder
    return ThroughputWatch(
        monitor.config.throughput,
        monitor._readings,
        now=started,  # uptime then covers every phase second the loop timer books
        device_name=device_name,
        parameter_dtype=probe.params[0].dtype if probe and probe.params else torch.float32,
        model=unwrap_model(monitor._model),
        anomaly=recorder.anomaly,
        write=recorder.write,
        global_step=lambda: recorder.global_step,
        limiter=monitor._limiter,
    )


def _param_signature(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Cheap per-step check for ``add_param_group``: group count and parameter count."""
    groups = optimizer.param_groups
    return len(groups), sum(len(group["params"]) for group in groups)


def _build_grad_probe(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Config, limiter: LogLimiter
) -> GradProbe:
    """The probe over ``optimizer``'s parameters, named from the (unwrapped) model."""
    return build_grad_probe(
        unwrap_model(model).named_parameters(),
        optimizer,
        module_depth=config.module_depth,
        max_modules=config.max_modules,
        limiter=limiter,
    )
