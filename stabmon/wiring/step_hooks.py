"""What the Monitor's hooks do at each boundary of a training step (training thread).

:class:`StepHooks` holds the parts the hooks use (:class:`~stabmon.wiring.assembly.Assembly`) as
attributes of its own, bound once at attach, so a hook body costs what it cost as a
method of the Monitor: one attribute lookup per part, no hop through the Monitor
(``bench/instructions.py`` counts it). :mod:`stabmon.wiring.hooks` registers its bound methods
with torch and holds this object weakly; so do the judge thread, the at-exit judgement
and the clip watch. The Monitor holds it, and nothing here refers back to the Monitor
(except a tracked loader's pass, which holds the Monitor it was begun by).

Every body runs under the guard: nothing raised inside stabmon reaches the training
loop, except :class:`~stabmon.errors.DeviceMismatchError`, which ``device_check: raise``
asks for.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from stabmon.errors import DeviceMismatchError, StabmonError
from stabmon.probes.amp import scale_tensor
from stabmon.probes.clipping import watch_clipping
from stabmon.probes.timing import timed_iteration
from stabmon.shared.guard import Guard
from stabmon.wiring.epochs import EpochMarks
from stabmon.wiring.hooks import HookSet, unwrap_model

if TYPE_CHECKING:
    from stabmon.wiring.assembly import Assembly

__all__ = ["StepHooks", "clip_seen", "judge_at_exit", "judge_if_quiet", "owns_param"]

T = TypeVar("T")


class StepHooks:
    """The bodies of the forward, optimizer-step and GradScaler hooks of one Monitor."""

    def __init__(
        self,
        parts: Assembly,
        *,
        model: torch.nn.Module,
        scaler: object | None,
        guard: Guard,
        measure_every: int,
        window_steps: int,
    ) -> None:
        self._model, self._scaler, self._guard = model, scaler, guard
        self._readings, self._recorder = parts.readings, parts.recorder
        self._sampler = parts.recorder.sampler
        self._measurements = parts.measurements
        self._engine = parts.measurements.engine
        self._plugged, self._placement = parts.plugged, parts.placement
        self._memory, self._workers = parts.memory, parts.workers
        self._heartbeat, self._timer = parts.heartbeat, parts.timer
        self._throughput = parts.throughput
        self._device_timer = parts.device_timer
        self._batches = parts.batches
        self._device_type = "cuda" if parts.devices else "cpu"
        self._measure_every = measure_every
        self._window_steps = window_steps
        self._pid = os.getpid()  # a forked child inherits the Monitor, not the run
        #: The epoch policy, shared with the Monitor's epoch_end(), track() and state_dict().
        self.epochs = EpochMarks()
        self._state_audited = False
        self._steps_at_update = 0
        # step(closure) (LBFGS): the closure computes the step's gradients inside the step,
        # so they are measured at its end, not before it.
        self._closure_step = False
        if scaler is not None:
            self._readings.amp_skipped_steps = 0

    def install(self, hooks: HookSet) -> None:
        """Register the hook methods (held weakly) and the clip watch, removed with ``hooks``."""
        try:
            hooks.install(
                forward_pre=self.forward_pre,
                forward_post=self.forward_post,
                step_pre=self.step_pre,
                step_post=self.step_post,
                scaler_update=self.scaler_update if self._scaler is not None else None,
            )
        except RuntimeError as error:  # e.g. a TorchScript module, which takes no Python hooks
            raise StabmonError(
                f"cannot install hooks on {type(self._model).__name__}: {error}; attach to the "
                "Python nn.Module before scripting it"
            ) from error
        with self._guard.contain("hooks"):
            this = weakref.ref(self)  # held weakly by the clip wrappers; removed with the hooks
            owns, seen = functools.partial(owns_param, this), functools.partial(clip_seen, this)
            hooks.keep(watch_clipping(owns, seen))

    # --- forward hooks ------------------------------------------------------------------------

    def forward_pre(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
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
        self._measurements.forget_preclip()
        try:
            self._batches.forward(self._recorder.global_step, args, kwargs)
        except Exception as error:
            self._guard.record("hooks", error)
        try:
            self._timer.forward_start()
            watch = self._throughput
            if self._readings.steps == watch.flops_step and not self._timer.in_named_phase:
                watch.forward_start(self._device_type, args, kwargs)  # once: the counted step
            elif watch.counting:
                watch.forward_counted(self._readings.steps)
        except Exception as error:
            self._guard.record("hooks", error)

    def forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or not module.training:
            return
        try:
            self._timer.forward_end()
        except Exception as error:
            self._guard.record("hooks", error)

    # --- optimizer step hooks -----------------------------------------------------------------

    def step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            watch = self._throughput
            if watch.counting:
                watch.optimizer_start()
            elif self._readings.steps == watch.flops_step:
                watch.no_forward_seen()  # the counted step's forward hook never ran
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
        if len(args) > 1 or kwargs:  # step(closure): measured at the step's end (step_post)
            self._closure_step = _closure_of(args, kwargs)
        if self._readings.steps % self._measure_every == 0 and not self._closure_step:
            self._measurements.step(optimizer)
        plugged = self._plugged
        if plugged.measures_before:  # a plug-in measures on the device: gradients in place
            plugged.measure_before(self._recorder.global_step, self._measurements.submit_device)
        if plugged.gates:  # on_anomaly: may hold this step back, or raise AnomalyStop
            plugged.gate_step(self._recorder.global_step, optimizer)

    def step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._closure_step:  # the closure's last gradients: this step's, as its index
            self._closure_step = False
            if self._readings.steps % self._measure_every == 0:
                self._measurements.step(optimizer)
        engine = self._engine
        now = engine.judged_at  # if the timer fails: collect, and judge at the next due step
        plugged = self._plugged
        if plugged.gates:  # undo what the gate changed for the step (gradients, LR)
            plugged.step_applied()
        if plugged.measures_after:  # a plug-in measures the new parameters on the device
            ended = self._readings.steps + self._recorder.step_offset  # not yet counted
            plugged.measure_after(ended, self._measurements.submit_device)
        with engine.lock:
            try:
                now = self._timer.optimizer_end()
                sampler = self._sampler
                ended = self._readings.steps + self._recorder.step_offset - 1  # global step
                if ended >= sampler.window_due:
                    if sampler.close_window(ended):  # many sample windows wait: judge them now
                        engine.judge_soon()
            except Exception as error:
                self._guard.record("hooks", error)
            self._poll(now)
        if now >= self._throughput.due:  # one comparison a step; a block every few seconds
            with self._guard.contain("detectors"):
                self._throughput.step_end(now)
        steps = self._readings.steps
        if steps % self._window_steps == 0 and self.epochs.by_steps():
            self.close_epoch()
        if steps >= plugged.next_step:  # one comparison a step; the plug-ins when one is due
            plugged.step_end(steps)

    def scaler_update(self) -> None:
        """After ``GradScaler.update()``: read the new scale; close a skipped iteration."""
        try:
            stepped = self._readings.steps != self._steps_at_update
            self._steps_at_update = self._readings.steps
            if not stepped:
                self._timer.iteration_skipped()  # the step hooks never ran
                self._measurements.forget_preclip()  # measured by a clip whose step was skipped
                self._throughput.abandon(self._readings.steps)
                if self._plugged.measures_before:  # the iteration ended: what it measured
                    self._plugged.measure_before(
                        self._recorder.global_step, self._measurements.submit_device
                    )
            step = self._recorder.global_step - (1 if stepped else 0)
            scale = scale_tensor(self._scaler)
            with self._engine.lock:
                if scale is not None:
                    self._measurements.scale(scale, step)
                self._poll(self._timer.clock())  # a skipped step: no step end
        except Exception as error:
            self._guard.record("hooks", error)

    def _poll(self, now: float) -> None:
        """Collect (and when due judge) read-back results, and the device timer's events;
        the engine's lock is held."""
        self._measurements.poll(now)
        if self._device_timer is not None:
            try:
                self._device_timer.poll()
            except Exception as error:
                self._guard.record("readback", error)

    def finish(self) -> None:
        """The last judgement's end (detach, interpreter exit): the device timer's last
        events, then what waits for a value; the engine's lock is held."""
        if self._device_timer is not None:
            self._device_timer.poll()
        self._measurements.finish()

    # --- the input side -----------------------------------------------------------------------

    def loader_wait(self, seconds: float) -> None:
        try:
            self._timer.loader_wait(seconds)
        except Exception as error:
            self._guard.record("hooks", error)

    def fetch_start(self) -> None:
        """A batch fetch begins: the loop waits for input (until ``loader_wait``)."""
        try:
            self._timer.fetch_start()
        except Exception as error:
            self._guard.record("hooks", error)

    def fetch_over(self) -> None:
        """A fetch ended without a batch (the loader's end, an error)."""
        try:
            self._timer.fetch_over()
        except Exception as error:
            self._guard.record("hooks", error)

    def timed_pass(self, loader: Iterable[T], *, keep: object = None) -> Iterator[T]:
        """One timed pass over ``loader`` (each ``iter()`` of what ``track()`` returned);
        the pass holds ``keep`` (the Monitor) until it is done."""
        steps_at_start = self._readings.steps
        followed: list[Any] = [None]  # the pass's batch identities, once it has begun

        def exhausted() -> None:
            _ = keep  # held by the pass's closure
            self.fetch_over()
            if steps_at_start == self._readings.steps:  # validation: its batches trained nothing
                with guard.contain("hooks"):
                    batches.untrained(followed[0])
            if self.epochs.pass_ended(steps_at_start, self._readings.steps):
                self.close_epoch()

        workers, batches, guard = self._workers, self._batches, self._guard

        def failed(error: BaseException) -> None:
            self.fetch_over()
            with guard.contain("hooks"):
                workers.failed(error)

        def begun(iterator: Iterator[T]) -> None:
            workers.follow(iterator)
            with guard.contain("hooks"):
                followed[0] = batches.follow(iterator)

        def fetched(seconds: float) -> None:
            self.loader_wait(seconds)
            try:
                batches.fetched(self._recorder.global_step, followed[0])  # the step it is for
            except Exception as error:
                guard.record("hooks", error)

        return self._throughput.counted(
            timed_iteration(
                batches.opening(loader, guard),  # iter() reads a DataLoader's draws through
                fetched,
                exhausted,
                clock=self._timer.clock,
                on_iterator=begun,
                on_error=failed,
                on_fetch=self.fetch_start,
            )
        )

    # --- host side ----------------------------------------------------------------------------

    def close_epoch(self) -> None:
        self._engine.judge_waiting()
        if self._device_timer is not None:  # the epoch's device time, as far as it has run
            with self._engine.lock, self._guard.contain("readback"):
                self._device_timer.poll()
        with self._guard.contain("memory"):
            samples, peaks = self._memory.epoch_samples()
            self._recorder.epoch(samples, peaks, self._plugged.epoch_memory(samples))
        # The epoch's last step, as its ``epoch`` record names it (docs/steps.md).
        self._plugged.epoch_end(self._recorder.last_step)
        with self._guard.contain("grads"):
            self._measurements.rebuild_if_trainable_changed()

    def judge_quiet(self) -> None:
        """Judge thread: judge what waits in a quiet loop (see stabmon.pipeline.judging). The device
        timer is left to the training thread, whose hooks record its events."""
        median = self._heartbeat.median_step_seconds()
        self._engine.judge_quiet(self._timer.clock(), self._heartbeat.last_beat, median)


def _closure_of(args: Any, kwargs: Any) -> bool:
    """Whether ``optimizer.step(closure)`` was given a closure (LBFGS); torch's step hooks get
    the step's own arguments, the optimizer first."""
    closure = args[1] if len(args) > 1 else kwargs.get("closure") if kwargs else None
    return callable(closure)


def judge_if_quiet(hooks: weakref.ref[StepHooks]) -> None:
    """The judge thread's task; holds the hooks weakly, like every thread."""
    target = hooks()
    if target is not None:
        target.judge_quiet()


def judge_at_exit(hooks: weakref.ref[StepHooks]) -> None:
    """atexit: judge the results still waiting, so an anomaly just before a crash is recorded.

    Copies still in flight on a device get half a second, as at detach (bounded: the
    device may be what failed), and the last step sample is written; the judge thread
    judges nothing after this. A forked child inherits the Monitor but not the run: it
    leaves the parent's results alone.
    """
    target = hooks()
    if target is None or target._engine.closed or target._pid != os.getpid():
        return
    target._engine.exit()
    target._engine.judge_last(0.5, target.finish)


def owns_param(hooks: weakref.ref[StepHooks], param: torch.Tensor) -> bool:
    """Whether ``param`` is measured by these hooks (held weakly by the clip wrappers)."""
    target = hooks()
    probe = None if target is None or target._engine.closed else target._measurements.probe
    return probe is not None and probe.owns(param)


def clip_seen(hooks: weakref.ref[StepHooks], params: Any, max_norm: float) -> None:
    target = hooks()
    if target is not None:
        target._measurements.clip(max_norm)
