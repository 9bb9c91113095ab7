"""The Monitor: the public API, wired at attach to the parts that do the work.

``Monitor`` holds no math and no judgement. :class:`~stabmon.wiring.assembly.Assembly`
builds its parts; :class:`~stabmon.wiring.step_hooks.StepHooks` holds what the hooks do;
:mod:`stabmon.pipeline.judging` decides when read-back results are judged;
:class:`~stabmon.wiring.resources.Resources` holds what ``detach()`` closes. Nothing a
thread or a hook holds refers back to the Monitor (docs/architecture.md, "Where things
live").
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch
from prometheus_client import CollectorRegistry

from stabmon.config import Config, load_config
from stabmon.contract import INTERNAL_COMPONENTS
from stabmon.errors import AlreadyAttachedError, StabmonError
from stabmon.extension import Factory
from stabmon.probes.environment import default_run_id, process_identity
from stabmon.probes.loader import loader_problem
from stabmon.probes.phases import PhaseBlock, PhaseNames
from stabmon.probes.timing import TrackedLoader
from stabmon.shared.guard import Guard
from stabmon.shared.log import LOGGER, LogLimiter
from stabmon.wiring.assembly import Assembly
from stabmon.wiring.hooks import HookSet, unwrap_model
from stabmon.wiring.registration import register
from stabmon.wiring.resources import SHUTDOWN_SECONDS, Resources
from stabmon.wiring.step_hooks import StepHooks, judge_at_exit, judge_if_quiet

__all__ = ["Monitor", "attach"]

T = TypeVar("T")

#: The longest ``detach()`` takes: the last judgement, then every thread and the server.
DETACH_SECONDS = 3.0
#: However long the last judgement took, the threads get at least this long to stop.
MIN_SHUTDOWN_SECONDS = 0.5


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scaler: object | None = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
    clock: Callable[[], float] | None = None,
    plugins: Sequence[Factory] = (),
    **overrides: Any,
) -> Monitor:
    """Attach a Monitor to ``model`` and ``optimizer`` and start exporting.

    ``config`` is a YAML path or a mapping; ``overrides`` are config keys
    (``port=0``, ``stall_seconds=5``). ``clock`` is the loop clock (seconds, monotonic;
    ``time.perf_counter`` by default) that times steps and ages the heartbeat for the
    stall watchdog: tests and simulations inject one. ``plugins`` are your own probes and
    detectors (:class:`stabmon.Plugin`; each a class, or a callable, taking the
    :class:`~stabmon.extension.Context`), plugged in after the built-ins. Raises
    :class:`~stabmon.ConfigError` for bad config, :class:`~stabmon.AlreadyAttachedError`
    when either object already has a Monitor, and :class:`~stabmon.StabmonError` when the
    hooks cannot be installed or ``plugins`` are not plug-ins; nothing else, and never
    after it returned.

    ``optimizer`` may come later, for trainers that build it once training starts
    (minGPT's ``Trainer.run()``): ``attach(model)`` watches the model at once, and the
    first optimizer whose ``step()`` updates the model's parameters is bound before that
    step runs (or bind it yourself: :meth:`Monitor.bind_optimizer`). Nothing of the first
    iteration is missed.

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
    return Monitor(
        model, optimizer, scaler=scaler, config=config, clock=clock, plugins=plugins, **overrides
    )


class Monitor:
    """Watches one model and optimizer; see :func:`attach`. Also a context manager."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scaler: object | None = None,
        config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
        clock: Callable[[], float] | None = None,
        plugins: Sequence[Factory] = (),
        **overrides: Any,
    ) -> None:
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise StabmonError(
                f"attach() needs the torch.optim.Optimizer whose step() ends each training "
                f"step (or None, to bind it later), got {type(optimizer).__name__}. A loop that "
                "updates parameters by hand can pass torch.optim.SGD(model.parameters(), "
                "lr=0.0) and call its step() after each update (lr=0 changes nothing); stabmon "
                "measures the gradients there"
            )
        # Until the optimizer exists, a stand-in over the model's trainable parameters (never
        # stepped) carries the step hooks and the gradient probe (pre-clip norms included).
        self._bound = optimizer is not None
        self._unbound_warned = False
        self._rejected: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._optimizer_watch: Any = None
        self._model_ref = weakref.ref(model)
        if optimizer is None:
            optimizer = _stand_in(model)
        self._optimizer = optimizer
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
                        clock or time.perf_counter, _plugin_factories(plugins))  # fmt: skip
            if not self._bound:
                hooks = self._resources.hooks
                assert hooks is not None  # set above
                self._optimizer_watch = hooks.watch_optimizers(self._step_seen)
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
        plugins: Sequence[Factory],
    ) -> None:
        cfg, guard, resources = self.config, self._guard, self._resources
        parts = Assembly(
            cfg, model, optimizer, run_id=self.run_id, rank=self.rank, plugins=plugins,
            guard=guard, limiter=self._limiter, resources=resources, clock=clock,
        )  # fmt: skip
        self._adopt(parts)
        self._steps = steps = StepHooks(
            parts, model=model, scaler=scaler, guard=guard, measure_every=cfg.measure_every,
            window_steps=cfg.window_steps,
        )  # fmt: skip
        parts.serve(local_rank=local_rank, local_world_size=local_world_size)
        register(
            resources, parts.paths, run_id=self.run_id, local_rank=local_rank,
            devices=parts.devices, metrics_url=self.metrics_url, stall_seconds=cfg.stall_seconds,
            steps=self._recorder.global_step, guard=guard, limiter=self._limiter,
        )  # fmt: skip
        # After register's exit hook: atexit runs them last in, first out, so the waiting
        # results are judged before the record says how the process ended.
        resources.judge_at_exit = functools.partial(judge_at_exit, weakref.ref(steps))
        atexit.register(resources.judge_at_exit)
        parts.start_threads(functools.partial(judge_if_quiet, weakref.ref(steps)))
        assert resources.hooks is not None  # set in __init__ before _start
        steps.install(resources.hooks)
        parts.announce(
            model, optimizer, metrics_url=self.metrics_url, event_log_path=self.event_log_path
        )

    def _adopt(self, parts: Assembly) -> None:
        """The parts the public methods use, as attributes (one lookup each per call)."""
        self._readings, self._recorder = parts.readings, parts.recorder
        self._context = parts.context
        self._measurements = parts.measurements
        self._engine = parts.measurements.engine
        self._plugged, self._timer = parts.plugged, parts.timer
        self._throughput, self._registry = parts.throughput, parts.registry
        self._batches = parts.batches
        self._phases = PhaseNames(self._limiter)
        # Decided at the first observe() when no forward hook fires (a compiled forward).
        self._observes_before_step: bool | None = None

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
        batch_ids: Sequence[int] | None = None,
        sample_losses: torch.Tensor | None = None,
    ) -> None:
        """Record this step's training loss: a tensor (kept on device, read later) or a float.

        Losses observed inside a named phase (``with mon.phase("eval")``) are
        evaluation losses and are left out of the training loss series.
        ``samples`` and ``tokens`` (Python ints) add to ``stabmon_samples_total`` and
        ``stabmon_tokens_total``; once given, ``track()`` no longer counts batches.
        ``batch_ids`` (with ``loss``; Python ints: sample indices) name this step's
        batch: a spike or a NaN names the batches of its last steps, in the event log and
        in ``rank-<rank>.skip_batches.json`` (docs/loops.md). ``sample_losses`` (with
        ``loss``: the batch's per-sample losses, ``reduction="none"``) adds the samples with
        the highest loss to those records (found on the device, read back later).
        """
        if (samples is not None or tokens is not None) and not self._detached:
            with self._guard.contain("hooks"):
                self._throughput.observed(samples, tokens)
        timer = self._timer
        if not self._bound:
            self._warn_unbound()
        if loss is None or self._detached or timer.in_named_phase:
            return
        try:
            step = self._recorder.step_offset + self._readings.steps  # global_step, inlined
            in_iteration = timer.in_iteration
            if not timer.forward_seen:
                # Hooks inside a compiled forward never fire: a loop that observes before its
                # optimizer step makes its first observe() before the first step.
                if self._observes_before_step is None:
                    self._observes_before_step = self._readings.steps == 0
                in_iteration = self._observes_before_step
            if not in_iteration and step and not timer.iteration_was_skipped:
                step -= 1  # observed after the step it belongs to (not after a skipped one)
            if batch_ids is not None:
                self._batches.observed(step, batch_ids)
            if sample_losses is not None:
                top = self._batches.top_samples(sample_losses)
                if top is not None:
                    self._measurements.submit_device(self._batches.judge_top, step, top)
            self._measurements.loss(loss, step, timer.last_step_seconds)
        except Exception as error:  # never break training
            self._guard.record("loss", error)

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Watch ``optimizer``'s steps from now on: for a Monitor attached to a model alone
        (``attach(model)``), once the trainer has built its optimizer.

        Binding is automatic at the first ``step()`` of an optimizer that updates the model's
        parameters, so this call is needed only to bind one before its first step, or to
        check which one is bound. Binding the optimizer already bound does nothing. Raises
        :class:`~stabmon.StabmonError` for an object that is not a ``torch.optim.Optimizer``
        or when another optimizer is bound, and :class:`~stabmon.AlreadyAttachedError` when
        another Monitor watches it.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise StabmonError(
                f"bind_optimizer() takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if self._bound:
            if optimizer is self._optimizer:
                return
            raise StabmonError(
                f"this Monitor already watches a {type(self._optimizer).__name__}; one Monitor "
                "watches one optimizer: attach another Monitor (its own run_id) to the model of "
                "the second optimizer"
            )
        if self._detached:
            raise StabmonError("bind_optimizer() after detach(): attach a new Monitor")
        self._bind(optimizer)
        watch, self._optimizer_watch = self._optimizer_watch, None
        if watch is not None:
            watch.remove()  # outside a step: torch is not running its global hooks

    def _step_seen(self, optimizer: torch.optim.Optimizer) -> None:
        """Before any optimizer's step (torch's global hook) until one is bound: bind the first
        that updates the model's parameters, before its step runs."""
        if self._bound or self._detached or optimizer is self._optimizer:
            return
        if optimizer in self._rejected:
            return
        with self._guard.contain("hooks"):
            if not _updates(optimizer, self._model_ref()):
                self._rejected.add(optimizer)  # another model's optimizer (a GAN's other half)
                return
            try:
                self._bind(optimizer)
            except AlreadyAttachedError:
                self._rejected.add(optimizer)
                self._limiter.once(
                    "bind:attached", logging.WARNING,
                    "stabmon: a %s updating this model steps, but another Monitor watches it; "
                    "this one stays unbound", type(optimizer).__name__,
                )  # fmt: skip
                return
            if self._optimizer_watch is not None:
                self._optimizer_watch.disarm()  # removed at detach: torch iterates the hooks

    def _bind(self, optimizer: torch.optim.Optimizer) -> None:
        hooks = self._resources.hooks
        assert hooks is not None  # set in __init__
        hooks.bind_optimizer(optimizer)  # AlreadyAttachedError: nothing changed
        self._optimizer, self._bound = optimizer, True
        self._measurements.bind(optimizer)
        self._context.optimizer = optimizer
        with self._guard.contain("hooks"):
            self._recorder.write(
                "optimizer_bound", step=self._recorder.last_step,
                optimizer=type(optimizer).__name__,
                parameters=sum(len(group["params"]) for group in optimizer.param_groups),
            )  # fmt: skip
            LOGGER.info("stabmon: bound the %s (run %s, rank %d)", type(optimizer).__name__,
                        self.run_id, self.rank)  # fmt: skip

    def _warn_unbound(self) -> None:
        """An observed iteration, and no optimizer has stepped the model yet: say so, once."""
        if self._unbound_warned or self._detached or not self._timer.forward_seen:
            return
        self._unbound_warned = True
        self._limiter.once(
            "bind:none", logging.WARNING,
            "stabmon: attached without an optimizer, and none has stepped the model's "
            "parameters yet: no step is counted or measured. Call mon.bind_optimizer(opt) or let "
            "the optimizer's first step() bind it; a loop that updates parameters by hand can "
            "bind torch.optim.SGD(model.parameters(), lr=0.0) and call its step() after each "
            "update (lr=0 changes nothing)",
        )  # fmt: skip

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
        if self._steps.epochs.user_marks(self._readings.steps):
            self._steps.close_epoch()

    def track(self, loader: Iterable[T]) -> TrackedLoader[T]:
        """Iterate ``loader``, timing the input wait; its exhaustion marks an epoch end.

        A pass in which no optimizer step happened (a validation loader) marks
        no epoch, and neither does any pass once ``epoch_end()`` is called. The
        result keeps the loader's ``len()`` and attributes (``.dataset``, ``.sampler``).
        """
        self._timer.track_loader()
        self._steps.epochs.by_loader = True
        with self._guard.contain("hooks"):
            problem = loader_problem(loader)
            if problem is not None:
                self._limiter.once("loader:timeout", logging.WARNING, "stabmon: %s", problem)
            if self._resources.worker_stacks is not None:
                self._resources.worker_stacks.install(loader)
        return TrackedLoader(loader, functools.partial(self._timed_pass, loader))

    def _timed_pass(self, loader: Iterable[T]) -> Iterator[T]:
        # A pass holds the Monitor: ``for x in stabmon.attach(model, opt).track(loader)``
        # keeps no other reference to it.
        return self._steps.timed_pass(loader, keep=self)

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
        self._steps.fetch_start()  # a hang in the block is a wait for input
        start = timer.clock()
        try:
            yield
        finally:
            self._steps.loader_wait(timer.clock() - start)

    @contextlib.contextmanager
    def phase(
        self, name: str, *, path: str | os.PathLike[str] | None = None
    ) -> Iterator[PhaseBlock]:
        """Attribute the time inside the block to the named phase (``eval``, ``checkpoint``).

        Inside it, the stall limit is ``phase_stall_seconds``, forward hooks are
        not timed as training, and observed losses are not training losses. A
        ``checkpoint`` phase is a save: ``path`` (where it writes) goes with its step into
        the rank's ``verdict.json`` as the last good checkpoint when no anomaly had
        damaged the parameters before it (docs/policies.md); ``block.path`` may name it
        inside the block instead (``with mon.phase("checkpoint") as block``).
        """
        label = self._phases.label(name)
        # A phase may take long (eval, checkpoint): what is on the host is judged before it,
        # copies still in flight by the judge thread during it (no step ends), or after it.
        # The device timer is left to the step ends, which poll it anyway.
        self._engine.judge_waiting()
        with self._guard.contain("hooks"):
            self._throughput.abandon(self._readings.steps)  # an eval is not the step's FLOPs
            self._timer.enter_named(label)
        completed, block = False, PhaseBlock(path)
        try:
            yield block
            completed = True
        finally:
            with self._guard.contain("hooks"):
                self._timer.exit_named()
            self._engine.judge_waiting()
            if label == "checkpoint" and not self._detached:
                saved = None if block.path is None else os.fspath(block.path)
                self._plugged.checkpoint_saved(self._recorder.last_step, saved, completed)

    def on_checkpoint_action(self, save: Callable[[int], object]) -> None:
        """Give ``on_anomaly``'s ``checkpoint`` action the loop's save: ``save(step)`` is
        called once, in the training thread, before the anomalous step is applied (or, for a
        kind judged late, at the next step), with the index of that step. Save inside
        ``with mon.phase("checkpoint", path=...)`` so the verdict knows the file.
        """
        for plugin in self._plugged.plugins:
            if hasattr(plugin, "save") and hasattr(plugin, "gate_step"):
                plugin.save = save

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
        state.update(self._plugged.state_dict())
        state["run_id"] = self.run_id
        state["epochs_marked_by"] = self._steps.epochs.state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: step and epoch numbering, spike statistics, memory
        baselines. Counters restart at 0 in a new process, which Prometheus reads as a reset.

        Raises :class:`~stabmon.StabmonError` for a state that is not one, and changes nothing.
        """
        # Results of the steps before the resume are judged against the old baselines; copies
        # in flight get a second, as in state_dict().
        self._engine.judge_waiting(wait_seconds=1.0)
        plugged = self._plugged
        self._recorder.load_state_dict(
            state, required=plugged.state_keys, restore=plugged.load_state_dict
        )
        with self._guard.contain("detectors"):
            self._throughput.restart(self._timer.clock())  # the first steps after a resume
        self._steps.epochs.load(state.get("epochs_marked_by"))

    def detach(self) -> None:
        """Remove every hook, stop every thread and free the port; idempotent."""
        if self._detached:
            return
        deadline = time.monotonic() + DETACH_SECONDS  # one bound for the whole detach
        self._engine.judge_last(1.0, self._steps.finish)  # bounded: never hang a detach
        with self._guard.contain("detectors"):
            self._throughput.close()
            self._throughput.record(self._timer.clock())  # the totals goodput reads
        self._plugged.detach()
        self._detached = True
        self._engine.close()
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

    def _held_back(self) -> bool:
        """For adapters whose real optimizer step follows the Monitor's (Lightning): whether
        ``on_anomaly`` held the step just gated back (docs/policies.md, "Adapters")."""
        return any(getattr(plugin, "held_back", False) for plugin in self._plugged.plugins)

    def _clips_after_measuring(self) -> None:
        """For adapters that step the Monitor before the framework clips (Lightning)."""
        self._measurements.clips_after_measuring()

    def _watch_output(self, hook: Callable[[Any, Any], None]) -> Callable[[], None]:
        """For adapters that read what the model returns (Hugging Face's unfiltered loss):
        ``hook(kwargs, output)`` after each forward of the root model, held weakly, removed
        by the returned callable or at detach."""
        hooks = self._resources.hooks
        if hooks is None or self._detached:
            return _nothing
        return hooks.watch_output(hook)


def _stand_in(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The never-stepped optimizer over the model's trainable parameters that carries the
    step hooks and the gradient probe until the real one is bound."""
    params = [p for p in unwrap_model(model).parameters() if p.requires_grad]
    if not params:
        raise StabmonError(
            f"attach() without an optimizer needs a model with trainable parameters; "
            f"{type(model).__name__} has none"
        )
    return torch.optim.SGD(params, lr=0.0)


def _updates(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> bool:
    """Whether ``optimizer`` holds any parameter of ``model``."""
    if model is None:
        return False
    ours = {id(p) for p in unwrap_model(model).parameters()}
    return any(id(p) in ours for group in optimizer.param_groups for p in group["params"])


def _nothing() -> None:
    """What removing a watch that was never installed does."""


def _plugin_factories(plugins: Sequence[Factory]) -> tuple[Factory, ...]:
    """``attach(plugins=...)``, checked: a sequence of callables (classes or factories)."""
    if isinstance(plugins, (str, bytes)) or not isinstance(plugins, Sequence):
        raise StabmonError(
            f"attach(plugins=...) takes a list of plug-in classes (or factories taking the "
            f"stabmon.extension.Context), got {type(plugins).__name__}"
        )
    for plugin in plugins:
        if not callable(plugin):
            raise StabmonError(
                f"attach(plugins=...) got {plugin!r}, which is not callable: pass the plug-in "
                "class (stabmon builds it with the Context at attach), not an instance"
            )
    return tuple(plugins)
