"""What the Monitor's hooks measure on device, and where each result goes once read back.

The hooks start measurements (the gradient probe's fused pass, the observed loss,
the GradScaler's scale, a clip's ``max_norm``) and submit them, tagged, to the
readback queue of the judging engine (:mod:`stabmon.pipeline.judging`); :meth:`Measurements.consume`
hands each result on the host to the judge its tag names: the recorder and the
plug-ins' hooks (:mod:`stabmon.extension`), the same call for every kind of result.
Never a sync: device values are copied back asynchronously (:mod:`stabmon.pipeline.readback`)
and read later.

The caller holds the engine's lock around :meth:`Measurements.poll` and
:meth:`Measurements.scale`; every other method takes it itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from stabmon.config import Config
from stabmon.pipeline.judging import MAX_WAITING_RESULTS, Judging
from stabmon.pipeline.readings import Readings
from stabmon.pipeline.recorder import Recorder
from stabmon.probes.grads import GradLayout, GradProbe, build_grad_probe
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter
from stabmon.wiring.hooks import unwrap_model
from stabmon.wiring.plugins import Plugged

__all__ = ["Measurements", "build_probe", "param_signature"]

#: Builds a named tuple in C, without the Python ``__new__`` that NamedTuple generates.
_tuple_new = tuple.__new__

#: Judges one read-back result on the host: (step, values, extra), under the judging lock.
Judge = Callable[[int, list[float], Any], None]


# A named tuple, not a frozen dataclass: one is built per measured step.
class Tag(NamedTuple):
    """What a read-back result is and who judges it; built with ``_tuple_new`` on the hot
    path (see :class:`~stabmon.probes.grads.GradSample`).

    The consumer calls ``judge(step, values, extra)`` for every result alike. A gradient
    result's ``extra`` is the layout it was measured with, which reads the values even when
    the probe was rebuilt while they waited (a new param group, a model moved or cast); a
    tag holds no tensor: results wait to be judged in batches, and a tensor would wait too.
    """

    judge: Judge
    step: int
    extra: Any


def param_signature(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Cheap per-step check for ``add_param_group``: group count and parameter count."""
    groups = optimizer.param_groups
    return len(groups), sum(len(group["params"]) for group in groups)


def build_probe(
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


class Measurements:
    """The gradient probe, the readback queue's tags, and the judges of what comes back."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: Config,
        *,
        readings: Readings,
        recorder: Recorder,
        plugged: Plugged,
        guard: Guard,
        limiter: LogLimiter,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._config = config
        self._readings = readings
        self._recorder = recorder
        self._plugged = plugged
        self._guard = guard
        self._limiter = limiter
        # Results are judged in batches, at most judge_seconds apart on the loop clock: the
        # host-side work then runs with warm caches (bench/overhead.py measures the saving
        # against judge_seconds 0 on its tiny MLP). The first result is judged at once.
        self.engine: Judging[Tag] = Judging(
            self.consume, guard=guard, judge_seconds=config.judge_seconds
        )
        #: Measures the gradients (None: it could not be built; it is built again at the
        #: next measured step).
        self.probe: GradProbe | None = None
        self._signature = param_signature(optimizer)
        # A measurement taken by a clip call before the step it belongs to (pre-clip norms):
        # (steps completed when taken, sample, layout), used by that step's pre-hook.
        self._preclip: tuple[int, Any, GradLayout] | None = None
        # This step's measurement (steps completed when taken, sample), for current_norms().
        self._current: tuple[int, Any] | None = None
        # Lightning measures at on_before_optimizer_step, before it clips: its clip belongs
        # to the step just measured (see clips_after_measuring()).
        self._clip_after_measure = False
        # Each kind of result's judge, bound once: a tag carries it, so none is built a step.
        self._judge_grads_ref: Judge = self._judge_grads
        self._judge_loss_ref: Judge = self._judge_loss
        self._judge_clip_ref: Judge = self._judge_clip
        self._judge_scale_ref: Judge = self._judge_scale
        with guard.contain("grads"):
            self.probe = build_probe(model, optimizer, config, limiter)

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Measure ``optimizer``'s parameters from now on (``Monitor.bind_optimizer``); a
        clip already measured for the step in progress keeps its measurement."""
        self._optimizer = optimizer
        self._signature = param_signature(optimizer)
        self.probe = None  # rebuilt at the next measurement if this build fails
        with self._guard.contain("grads"):
            self.probe = build_probe(self._model, optimizer, self._config, self._limiter)

    def clips_after_measuring(self) -> None:
        """For adapters that step the Monitor before the framework clips (Lightning)."""
        self._clip_after_measure = True

    def forget_preclip(self) -> None:
        """New gradients are coming (a forward), or the clip's step was skipped: a
        measurement a clip took before is stale."""
        self._preclip = None

    # --- training thread --------------------------------------------------------------------

    def current_probe(self, optimizer: torch.optim.Optimizer) -> GradProbe:
        """The gradient probe, rebuilt when the optimizer's parameters changed
        (``add_param_group()``): the step pre-hook and the clip watch both measure with it."""
        groups = optimizer.param_groups
        count = 0
        for group in groups:  # param_signature, inlined: this runs every measured step
            count += len(group["params"])
        probe = self.probe
        if (len(groups), count) != self._signature or probe is None:
            self._signature = (len(groups), count)  # add_param_group(): measure anew
            probe = self.probe = build_probe(self._model, optimizer, self._config, self._limiter)
        return probe

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """At a measured step's pre-hook: measure the gradients (or use the clip's)."""
        try:
            preclip = self._preclip
            if preclip is not None and preclip[0] == self._readings.steps:
                # Measured by this step's clip call, before clipping scaled the gradients.
                self._preclip = None
                sample, layout = preclip[1], preclip[2]
            else:
                probe = self.current_probe(optimizer)
                sample = probe.measure()
                layout = probe.layout  # measure() rebuilt it first if the model moved
            self._current = (self._readings.steps, sample)
            if sample is not None:
                # Recorder.global_step, inlined (a property call fewer, every measured step).
                step = self._recorder.step_offset + self._readings.steps
                tag = _tuple_new(Tag, (self._judge_grads_ref, step, layout))
                with self.engine.lock:
                    self.engine.readback.submit(tag, sample.packed)
        except Exception as error:
            self._guard.record("grads", error)

    def current_norms(self) -> torch.Tensor | list[float] | None:
        """The norm of each gradient in place now, before any clip: this step's measurement
        when the step pre-hook (or its clip, before clipping) took one, else measured now;
        None without gradients. Training thread, at the step pre-hook; never a sync."""
        current = self._current
        if current is None or current[0] != self._readings.steps:
            current = (self._readings.steps, self.current_probe(self._optimizer).measure())
        sample = current[1]
        return None if sample is None else sample.packed

    def submit_device(self, judge: Judge, step: int, values: torch.Tensor) -> None:
        """A device plug-in's measurement (:mod:`stabmon.extension`), judged by ``judge``."""
        with self.engine.lock:
            self.engine.readback.submit(_tuple_new(Tag, (judge, step, None)), values)

    def clip(self, max_norm: float) -> None:
        """A clip of our parameters is about to scale the gradients: measure them first.

        The measurement is the one the step pre-hook would take (moved earlier, same cost);
        ``max_norm`` goes to the clip judges. Never a sync.
        """
        try:
            step = self._recorder.step_offset + self._readings.steps  # global_step, inlined
            if self._clip_after_measure:
                step = max(step - 1, 0)  # Lightning: the step was measured (and counted) already
            elif self._readings.steps % self._config.measure_every == 0:
                probe = self.current_probe(self._optimizer)
                sample = probe.measure()
                self._preclip = (
                    None if sample is None else (self._readings.steps, sample, probe.layout)
                )
            tag = _tuple_new(Tag, (self._judge_clip_ref, step, None))
            with self.engine.lock:
                self.engine.readback.submit(tag, [max_norm])
        except Exception as error:
            self._guard.record("grads", error)

    def loss(
        self, loss: torch.Tensor | float, step: int, step_seconds: float = float("inf")
    ) -> None:
        """Submit an observed loss for ``step`` (a tensor is kept on device, read later).

        ``step_seconds``, the last step's duration: in a loop whose steps are shorter than
        ``judge_seconds`` (its results wait that long to be judged anyway) a device loss's
        copy records no event of its own; the next step's gradient copy marks it done (one
        CUDA event record a step fewer, issue 38; at most a step later on the host)."""
        tag = _tuple_new(Tag, (self._judge_loss_ref, step, None))
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
                # Read back in its own dtype (tolist() gives the exact value as a float): a
                # conversion would be one more launch a step (issue 38). A 0-d loss is copied
                # as it is, into a 1-element buffer: no reshape either.
                host = value.detach() if value.dim() == 0 else value.detach().reshape(1)
        else:
            host = [float(loss)]  # through the queue too (a complex raises here: skipped)
        engine = self.engine
        with engine.lock:
            # A fast step's loss: no event of its own, the next step's gradient copy (or the
            # next collect, without one) marks it done.
            waiting = engine.readback.submit(tag, host, step_seconds >= engine.judge_seconds)
            if not engine.judge_seconds or waiting >= MAX_WAITING_RESULTS:
                # judge_seconds 0: each result once it is on the host. Or many losses
                # came without a step end (hooks that do not fire): they wait no longer.
                self.consume(engine.readback.poll())

    def scale(self, scale: torch.Tensor, step: int) -> None:
        """Submit the GradScaler's new scale (a device scalar), read for ``step``; lock held."""
        self.engine.readback.submit(Tag(self._judge_scale_ref, max(step, 0), None), scale)

    def rebuild_if_trainable_changed(self) -> None:
        """At an epoch end: a parameter frozen or unfrozen since attach is measured anew."""
        if self.probe is not None and self.probe.trainable_changed():
            self.probe = build_probe(self._model, self._optimizer, self._config, self._limiter)

    # --- host side (the caller holds the engine's lock) -------------------------------------

    def poll(self, now: float) -> None:
        """Collect finished reads every step; judge them once ``judge_seconds`` have passed."""
        engine = self.engine
        try:
            waiting = engine.readback.collect()
            # Judging.due, inlined (a Python call fewer a step): judge_seconds since the last
            # judgement, or too many waiting.
            if waiting and (
                now - engine.judged_at >= engine.judge_seconds or waiting >= MAX_WAITING_RESULTS
            ):
                engine.judged_at = now
                self.consume(engine.readback.poll())
        except Exception as error:
            self._guard.record("readback", error)

    def finish(self) -> None:
        """The last judgement's end: the step sample still waiting for a value, and what the
        plug-ins still hold open."""
        self._recorder.flush_sample()
        self._plugged.finish()

    def consume(self, results: Sequence[tuple[Tag, list[float]]]) -> None:
        for tag, values in results:
            try:  # per result, so one bad value does not lose the others
                tag.judge(tag.step, values, tag.extra)
            except Exception as error:
                self._guard.record("detectors", error)

    def _judge_grads(self, step: int, values: list[float], layout: GradLayout) -> None:
        summary = layout.summarize(values)  # the layout it was measured with, however old
        self._recorder.grads(step, summary)
        self._plugged.grads_judged(step, summary)

    def _judge_loss(self, step: int, values: list[float], extra: object) -> None:
        self._recorder.loss(step, values[0])
        self._plugged.loss_judged(step, values[0])

    def _judge_clip(self, step: int, values: list[float], extra: object) -> None:
        self._plugged.clip_judged(step, values[0])

    def _judge_scale(self, step: int, values: list[float], extra: object) -> None:
        self._plugged.scale_judged(step, values[0])
