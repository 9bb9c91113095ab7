"""The Monitor: the public API, and the hooks that wire probes to the judging engine.

``Monitor`` holds no math and no judgement. :mod:`stabmon.assembly` builds its parts
at attach; its hooks time the loop (:class:`~stabmon.probes.timing.LoopTimer`),
start device-side measurements (:class:`~stabmon.measurements.Measurements`) whose
results come back through the readback queue of the judging engine
(:mod:`stabmon.judging`: which thread judges what, and when), and call the plug-ins
(:mod:`stabmon.plugins`) at the step and epoch ends. Every hook body runs under the
guard: nothing raised inside stabmon reaches the training loop.

Resources (hooks, threads, the HTTP server, the event log) live in one bundle
(:class:`~stabmon.resources.Resources`) closed by ``detach()``, or by a finalizer if
the Monitor is dropped without it; nothing a thread or a hook holds refers back to
the Monitor.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch
from prometheus_client import CollectorRegistry

from stabmon import assembly
from stabmon.config import Config, load_config
from stabmon.contract import INTERNAL_COMPONENTS
from stabmon.epochs import EpochMarks
from stabmon.errors import DeviceMismatchError, StabmonError
from stabmon.guard import Guard
from stabmon.hooks import HookSet, unwrap_model
from stabmon.log import LOGGER, LogLimiter
from stabmon.probes.amp import scale_tensor
from stabmon.probes.clipping import watch_clipping
from stabmon.probes.environment import default_run_id, describe_environment, process_identity
from stabmon.probes.loader import loader_problem
from stabmon.probes.phases import PhaseNames
from stabmon.probes.timing import TrackedLoader, timed_iteration
from stabmon.registration import check_local_rank, register
from stabmon.resources import SHUTDOWN_SECONDS, Resources

__all__ = ["Monitor", "attach"]

T = TypeVar("T")

#: The longest ``detach()`` takes: the last judgement, then every thread and the server.
DETACH_SECONDS = 3.0
#: However long the last judgement took, the threads get at least this long to stop.
MIN_SHUTDOWN_SECONDS = 0.5


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scaler: object | None = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
    clock: Callable[[], float] | None = None,
    **overrides: Any,
) -> Monitor:
    """Attach a Monitor to ``model`` and ``optimizer`` and start exporting.

    ``config`` is a YAML path or a mapping; ``overrides`` are config keys
    (``port=0``, ``stall_seconds=5``). ``clock`` is the loop clock (seconds, monotonic;
    ``time.perf_counter`` by default) that times steps and ages the heartbeat for the
    stall watchdog: tests and simulations inject one. Raises :class:`~stabmon.ConfigError`
    for bad config, :class:`~stabmon.AlreadyAttachedError` when either object already
    has a Monitor, and :class:`~stabmon.StabmonError` when the hooks cannot be
    installed; nothing else, and never after it returned.

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
    return Monitor(model, optimizer, scaler=scaler, config=config, clock=clock, **overrides)


class Monitor:
    """Watches one model and optimizer; see :func:`attach`. Also a context manager."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: object | None = None,
        config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
        clock: Callable[[], float] | None = None,
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
        self._resources = Resources(hooks=HookSet(model, optimizer, scaler))
        self._finalizer = weakref.finalize(self, self._resources.close)
        # At interpreter exit the atexit hook records how the run ended; removing the
        # record then would make a crash look like a clean detach.
        self._finalizer.atexit = False
        self._detached = False
        try:
            self._start(model, optimizer, scaler, identity.local_rank, identity.local_world_size,
                        clock or time.perf_counter)  # fmt: skip
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
        clock: Callable[[], float],
    ) -> None:
        cfg, guard, resources = self.config, self._guard, self._resources
        parts = assembly.build(
            cfg, model, optimizer, run_id=self.run_id, rank=self.rank, guard=guard,
            limiter=self._limiter, resources=resources, clock=clock,
        )  # fmt: skip
        self._adopt(parts, model, optimizer, scaler)
        assembly.serve(parts, cfg, resources, guard=guard, limiter=self._limiter,
                       local_rank=local_rank, local_world_size=local_world_size)  # fmt: skip
        register(
            resources, parts.paths, run_id=self.run_id, local_rank=local_rank,
            devices=parts.devices, metrics_url=self.metrics_url, stall_seconds=cfg.stall_seconds,
            steps=self._recorder.global_step, guard=guard, limiter=self._limiter,
        )  # fmt: skip
        # After register's exit hook: atexit runs them last in, first out, so the waiting
        # results are judged before the record says how the process ended.
        resources.judge_at_exit = functools.partial(_judge_at_exit, weakref.ref(self))
        atexit.register(resources.judge_at_exit)
        assembly.start_threads(
            parts, cfg, resources, guard=guard, run_id=self.run_id, rank=self.rank,
            judge_quiet=functools.partial(_judge_if_quiet, weakref.ref(self)), clock=clock,
        )  # fmt: skip
        self._install_hooks(model, scaler)
        self._announce(parts.devices, model, optimizer)

    def _adopt(
        self,
        parts: assembly.Parts,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: object | None,
    ) -> None:
        """The parts the hooks use, as attributes (one lookup each on the hot path)."""
        cfg = self.config
        self._model, self._optimizer, self._scaler = model, optimizer, scaler
        self._readings, self._recorder = parts.readings, parts.recorder
        self._sampler = parts.recorder.sampler
        self._measurements = parts.measurements
        self._engine = parts.measurements.engine
        self._plugged, self._placement = parts.plugged, parts.placement
        self._memory, self._workers = parts.memory, parts.workers
        self._heartbeat, self._timer = parts.heartbeat, parts.timer
        self._device_timer, self._throughput = parts.device_timer, parts.throughput
        self._device_type = "cuda" if parts.devices else "cpu"
        self._registry = parts.registry
        self._pid = os.getpid()  # a forked child inherits the Monitor, not the run
        self._measure_every = cfg.measure_every
        self._window_steps = cfg.window_steps
        self._epochs = EpochMarks()
        self._state_audited = False
        self._steps_at_update = 0
        if scaler is not None:
            self._readings.amp_skipped_steps = 0
        self._phases = PhaseNames(self._limiter)
        # Decided at the first observe() when no forward hook fires (a compiled forward).
        self._observes_before_step: bool | None = None

    def _install_hooks(self, model: torch.nn.Module, scaler: object | None) -> None:
        resources = self._resources
        assert resources.hooks is not None  # set in __init__ before _start
        try:
            resources.hooks.install(
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
            this = weakref.ref(self)  # held weakly by the clip wrappers; removed with the hooks
            resources.hooks.keep(
                watch_clipping(
                    functools.partial(_owns_param, this), functools.partial(_clip_seen, this)
                )
            )

    def _announce(
        self,
        devices: tuple[torch.device, ...],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """The attach record (environment, config), the identity checks, the log line."""
        cfg, guard = self.config, self._guard
        probe = self._measurements.probe
        environment, gpus = describe_environment(self._readings.build_info, devices, guard)
        if gpus:
            self._readings.device_info = gpus
        self._recorder.write(
            "attach", environment=environment, config=cfg.to_dict(), pid=os.getpid(),
            metrics_url=self.metrics_url, parameters=len(probe.names) if probe else 0,
            module_groups=list(probe.groups) if probe else [],
        )  # fmt: skip
        check_local_rank(self._recorder, guard)
        if self._placement is not None:  # after the attach record, which opens the event log
            self._placement.audit(unwrap_model(model), optimizer)  # raises only in raise mode
        LOGGER.info(
            "stabmon: attached (run %s, rank %d); metrics at %s; events in %s",
            self.run_id,
            self.rank,
            self.metrics_url or "(no exporter)",
            self.event_log_path or "(no event log)",
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
            self._measurements.loss(loss, step)
        except Exception as error:  # never break training
            self._guard.record("loss", error)

    def contain(self) -> contextlib.AbstractContextManager[None]:
        """Run an adapter's own per-step work under this Monitor's guard.

        An ``Exception`` inside the block is counted in
        ``stabmon_internal_errors_total{component="hooks"}``, logged once, and not
        raised: the framework's training loop goes on.
        """
        return self._guard.contain("hooks")

    def epoch_end(self) -> None:
        """Mark an epoch boundary: sample memory, judge drift and leaks, log a summary.

        Once called, explicit calls alone mark epochs (``track()`` no longer does).
        """
        if self._detached:
            return
        if self._epochs.user_marks(self._readings.steps):
            self._close_epoch()

    def track(self, loader: Iterable[T]) -> TrackedLoader[T]:
        """Iterate ``loader``, timing the input wait; its exhaustion marks an epoch end.

        A pass in which no optimizer step happened (a validation loader) marks
        no epoch, and neither does any pass once ``epoch_end()`` is called. The
        result keeps the loader's ``len()`` and attributes (``.dataset``, ``.sampler``).
        """
        self._timer.track_loader()
        self._epochs.by_loader = True
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
            if self._epochs.pass_ended(steps_at_start, self._readings.steps):
                self._close_epoch()

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
        label = self._phases.label(name)
        # A phase may take long (eval, checkpoint): what is on the host is judged before it,
        # copies still in flight by the judge thread during it (no step ends), or after it.
        # The device timer is left to the step ends, which poll it anyway.
        self._engine.judge_waiting()
        with self._guard.contain("hooks"):
            self._throughput.abandon(self._readings.steps)  # an eval is not the step's FLOPs
            self._timer.enter_named(label)
        try:
            yield
        finally:
            with self._guard.contain("hooks"):
                self._timer.exit_named()
            self._engine.judge_waiting()

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
        self._engine.judge_waiting(wait_seconds=1.0)
        state = self._recorder.state_dict()
        state["run_id"] = self.run_id
        state["epochs_marked_by"] = self._epochs.state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: step and epoch numbering, spike statistics, memory
        baselines. Counters restart at 0 in a new process, which Prometheus reads as a reset.

        Raises :class:`~stabmon.StabmonError` for a state that is not one, and changes nothing.
        """
        # Results of the steps before the resume are judged against the old baselines; copies
        # in flight get a second, as in state_dict().
        self._engine.judge_waiting(wait_seconds=1.0)
        self._recorder.load_state_dict(state)
        with self._guard.contain("detectors"):
            self._throughput.restart(self._timer.clock())  # the first steps after a resume
        self._epochs.load(state.get("epochs_marked_by"))

    def detach(self) -> None:
        """Remove every hook, stop every thread and free the port; idempotent."""
        if self._detached:
            return
        deadline = time.monotonic() + DETACH_SECONDS  # one bound for the whole detach
        self._engine.judge_last(1.0, self._measurements.finish)  # bounded: never hang a detach
        with self._guard.contain("detectors"):
            self._throughput.close()
            self._throughput.record(self._timer.clock())  # the totals goodput reads
        self._plugged.detach()
        self._detached = True
        self._engine.closed = True
        self._recorder.detached()
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
        # New gradients are coming: a clip measured before is stale.
        self._measurements.preclip = None
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
        if self._readings.steps % self._measure_every == 0:
            self._measurements.step(optimizer)

    def _clips_after_measuring(self) -> None:
        """For adapters that step the Monitor before the framework clips (Lightning)."""
        self._measurements.clip_after_measure = True

    def _on_step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        engine = self._engine
        now = engine.judged_at  # if the timer fails: collect, and judge at the next due step
        with engine.lock:
            try:
                now = self._timer.optimizer_end()
                sampler = self._sampler
                ended = self._readings.steps + self._recorder.step_offset - 1  # global step
                if ended >= sampler.window_due:
                    if sampler.close_window(ended):  # many sample windows wait: judge them now
                        engine.judged_at = -float("inf")
            except Exception as error:
                self._guard.record("hooks", error)
            self._measurements.poll(now)
        if now >= self._throughput.due:  # one comparison a step; a block every few seconds
            with self._guard.contain("detectors"):
                self._throughput.step_end(now)
        steps = self._readings.steps
        if steps % self._window_steps == 0 and self._epochs.by_steps():
            self._close_epoch()
        plugged = self._plugged
        if steps >= plugged.next_step:  # one comparison a step; the plug-ins when one is due
            plugged.step_end(steps)

    def _on_scaler_update(self) -> None:
        """After ``GradScaler.update()``: read the new scale; close a skipped iteration."""
        try:
            stepped = self._readings.steps != self._steps_at_update
            self._steps_at_update = self._readings.steps
            if not stepped:
                self._timer.iteration_skipped()  # the step hooks never ran
                self._measurements.preclip = None  # measured by a clip whose step was skipped
                self._throughput.abandon(self._readings.steps)
            step = self._recorder.global_step - (1 if stepped else 0)
            scale = scale_tensor(self._scaler)
            with self._engine.lock:
                if scale is not None:
                    self._measurements.scale(scale, step)
                self._measurements.poll(self._timer.clock())  # a skipped step: no step end
        except Exception as error:
            self._guard.record("hooks", error)

    def _loader_wait(self, seconds: float) -> None:
        try:
            self._timer.loader_wait(seconds)
        except Exception as error:
            self._guard.record("hooks", error)

    # --- host side ----------------------------------------------------------------------------

    def _judge_quiet(self) -> None:
        """Judge thread: judge what waits in a quiet loop (see stabmon.judging). The device
        timer is left to the training thread, whose hooks record its events."""
        median = self._heartbeat.median_step_seconds()
        self._engine.judge_quiet(self._timer.clock(), self._heartbeat.last_beat, median)

    def _close_epoch(self) -> None:
        self._engine.judge_waiting()
        with self._guard.contain("memory"):
            samples, peaks = self._memory.epoch_samples()
            self._recorder.epoch(samples, peaks)
        # The epoch's last step, as its ``epoch`` record names it (docs/steps.md).
        self._plugged.epoch_end(self._recorder.last_step)
        with self._guard.contain("grads"):
            self._measurements.rebuild_if_trainable_changed()


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
    target._engine.judge_last(0.5, target._measurements.finish)


def _owns_param(monitor: weakref.ref[Monitor], param: torch.Tensor) -> bool:
    """Whether ``param`` is measured by the Monitor (held weakly by the clip wrappers)."""
    target = monitor()
    probe = None if target is None or target._detached else target._measurements.probe
    return probe is not None and probe.owns(param)


def _clip_seen(monitor: weakref.ref[Monitor], params: Any, max_norm: float) -> None:
    target = monitor()
    if target is not None:
        target._measurements.clip(max_norm)
