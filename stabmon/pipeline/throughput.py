"""Throughput of one training process: samples, tokens, FLOPs, MFU, and the slowdown rule.

Design: everything here runs on the training thread, at step ends, and costs one
comparison per step between blocks (``due``). At the first step end at least
``throughput.slowdown_block_seconds`` after the last block, the block is closed:
the seconds each built-in phase took since the last block (from the phase
counters the loop timer keeps anyway) and the steps done go to the slowdown
detector, and the FLOP counter and the MFU gauge are brought up to date. Samples
come from the batches ``track()`` hands out (their leading dimension: shape
metadata, no device read) or from ``observe(samples=..., tokens=...)``, which,
once used, is the only source. FLOPs are counted once (:mod:`stabmon.probes.flops`).

Every ``throughput.record_seconds`` a ``throughput`` record goes to the event log
with this process's running totals; ``stabmon report`` turns them into goodput.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from stabmon.config import ThroughputConfig
from stabmon.contract import PHASES
from stabmon.detectors.slowdown import Block, Slowdown, SlowdownDetector
from stabmon.pipeline.readings import Readings
from stabmon.probes.flops import (
    FlopCount,
    compile_in_use,
    compute_dtype,
    count_on_meta,
    meta_like,
    peak_flops,
)
from stabmon.shared.log import LogLimiter

if TYPE_CHECKING:
    from stabmon.extension import Context

__all__ = ["ThroughputWatch", "batch_samples", "batch_tokens"]

T = TypeVar("T")
#: Never a step: flops_step when no count is due.
_NEVER = -1
#: Forwards a counted step may take (gradient accumulation); more means no step is coming.
MAX_COUNTED_FORWARDS = 1024


def batch_samples(batch: object) -> int | None:
    """The leading dimension of the batch's first tensor (a tensor, or one inside a tuple,
    list or mapping, ``input_ids`` first), or None when there is none."""
    tensor = _first_tensor(batch, depth=0)
    if tensor is None or tensor.dim() == 0:
        return None
    return int(tensor.shape[0])


def batch_tokens(batch: object) -> int | None:
    """Tokens of a Hugging Face style batch: ``input_ids`` of shape (batch, sequence), padding
    included; None for any other batch (give ``observe(tokens=...)`` then)."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            return int(ids.shape[0]) * int(ids.shape[1])
    return None


def _first_tensor(batch: object, depth: int) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if depth >= 3:
        return None
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids
        items: Iterable[object] = batch.values()
    elif isinstance(batch, (tuple, list)):
        items = batch
    else:
        return None
    for item in items:
        found = _first_tensor(item, depth + 1)
        if found is not None:
            return found
    return None


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The eager module inside torch.compile (``_orig_mod``) and DDP (``.module``)."""
    for _ in range(8):  # wrappers nest (compile of DDP); never loop on a self-reference
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "module", None) if _is_data_parallel(model) else None
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model


def _is_data_parallel(model: torch.nn.Module) -> bool:
    names = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")
    return type(model).__name__ in names


def build_throughput(
    config: ThroughputConfig,
    readings: Readings,
    *,
    model: torch.nn.Module,
    devices: Sequence[torch.device],
    parameters: Sequence[torch.Tensor],
    started: float,
    context: Context,
    limiter: LogLimiter,
) -> ThroughputWatch:
    """Throughput and slowdown accounting; MFU only where a CUDA device's peak is known.

    ``context`` (:class:`~stabmon.extension.Context`) gets the anomalies and events;
    ``started`` is at or before the loop timer's first mark, so uptime covers every phase
    second it books.
    """
    device_name = None
    if devices:
        try:
            device_name = torch.cuda.get_device_name(devices[0])
        except (AssertionError, RuntimeError):
            device_name = ""  # a GPU without properties: in no table, so no MFU
    return ThroughputWatch(
        config,
        readings,
        now=started,
        device_name=device_name,
        parameter_dtype=parameters[0].dtype if parameters else torch.float32,
        model=model,
        anomaly=context.anomaly,
        write=context.event,
        global_step=lambda: context.global_step,
        limiter=limiter,
    )


class ThroughputWatch:
    """Throughput accounting and the slowdown rule of one Monitor (training thread only)."""

    def __init__(
        self,
        config: ThroughputConfig,
        readings: Readings,
        *,
        now: float,
        device_name: str | None,
        parameter_dtype: torch.dtype,
        model: torch.nn.Module,
        anomaly: Callable[..., None],
        write: Callable[..., None],
        global_step: Callable[[], int],
        limiter: LogLimiter,
    ) -> None:
        self._config = config
        self._readings = readings
        self._anomaly = anomaly
        self._write = write
        self._global_step = global_step
        self._limiter = limiter
        self._device_name = device_name
        self._parameter_dtype = parameter_dtype
        self._dtype: str | None = None if config.mfu_dtype == "auto" else config.mfu_dtype
        self._detector = SlowdownDetector(
            threshold=config.slowdown_threshold,
            hold_seconds=config.slowdown_hold_seconds,
            baseline_seconds=config.slowdown_baseline_seconds,
        )
        self._started = now
        self._block_steps = readings.steps
        self._block_phases = self._train_phases()
        self._block_device = dict(readings.device_phase_seconds)
        self._judged_from = readings.steps + config.slowdown_warmup_steps
        self._explicit = False  # set by observe(samples=...): track() then counts nothing
        self._counter = FlopCount()
        self._model = model
        self._forwards = 0
        #: The counted step's first forward, as meta tensors, while it waits to be replayed
        #: (torch.compile in use: the counting mode stays off the step itself).
        self._replay: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        #: Whether a FLOP count is open (the mode on, or a forward kept for replay): an
        #: attribute the step hooks read twice a step (a property was two Python calls each,
        #: issue 38), set again from the truth wherever a count opens or closes.
        self.counting = False
        self.flops_per_step: float | None = config.flops_per_step
        self._fresh_flops = False  # counted at this block's step: the block has no MFU
        #: The step count (since attach) whose forward starts the FLOP count; -1: none due.
        self.flops_step = config.flops_measure_step if config.flops_measure_step else _NEVER
        if self.flops_per_step is not None and self._dtype is not None:
            self.flops_step = _NEVER  # nothing left to learn at a step
        #: The loop-clock time of the next block end; callers compare before calling.
        self.due = now + config.slowdown_block_seconds
        self._record_due = now + config.record_seconds
        if self.flops_per_step is not None:
            readings.flops_per_step, readings.flops_from_steps = self.flops_per_step, readings.steps
        self._update_peak()

    # --- samples and tokens -------------------------------------------------------------------

    def counted(self, batches: Iterator[T]) -> Iterator[T]:
        """Yield ``batches``, counting the samples (and tokens) of each as it is handed out."""
        readings = self._readings
        for batch in batches:
            if not self._explicit:
                samples = batch_samples(batch)
                if samples is not None:
                    readings.samples += samples
                tokens = batch_tokens(batch)
                if tokens is not None:
                    readings.tokens += tokens
            yield batch

    def observed(self, samples: object, tokens: object) -> None:
        """``observe(samples=..., tokens=...)``: plain integers (a tensor would mean a read)."""
        self._explicit = True
        for name, value in (("samples", samples), ("tokens", tokens)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                shown = value if isinstance(value, int) else f"<{type(value).__name__}>"
                self._limiter.once(  # never the value of a tensor: printing one reads it
                    f"observe-{name}",
                    logging.WARNING,
                    "stabmon: observe(%s=%s) ignored: pass a Python int >= 0, such as "
                    "batch.shape[0] (logged once)",
                    name,
                    shown,
                )
                continue
            if name == "samples":
                self._readings.samples += value
            else:
                self._readings.tokens += value

    # --- FLOPs --------------------------------------------------------------------------------

    def forward_start(self, device_type: str, args: tuple[Any, ...], kwargs: Any) -> None:
        """The first forward of step ``flops_step``: read the dtype, start counting.

        Eager, every operator of the step goes through the counting mode. With torch.compile
        in use the step is left alone and its first forward is kept as meta tensors (shapes
        only), replayed eagerly at the optimizer step (:func:`~stabmon.probes.flops.count_on_meta`).
        """
        self.flops_step = _NEVER
        if self._dtype is None:
            self._dtype = compute_dtype(device_type, self._parameter_dtype)
            self._update_peak()
        if self.flops_per_step is not None:
            return
        self._forwards = 1
        try:
            if compile_in_use(self._model):
                self._replay = (meta_like(tuple(args)), meta_like(dict(kwargs or {})))
                return
            self._counter.start()
        finally:
            self._recount()

    def forward_counted(self, steps: int) -> None:
        """Another forward inside the counted step; a step that never comes is given up."""
        self._forwards += 1
        if self._forwards > MAX_COUNTED_FORWARDS:
            self._counter.abandon()
            self._replay = None
            self._recount()
            self.flops_step = _NEVER
            self._unavailable(
                f"no optimizer step came within {MAX_COUNTED_FORWARDS} forwards of step {steps}"
            )

    def _recount(self) -> None:
        self.counting = self._counter.counting or self._replay is not None

    def optimizer_start(self) -> None:
        """The counted step reached its optimizer step: its FLOPs are known (or why not)."""
        replayed = self._replay is not None
        try:
            flops = self._replayed() if replayed else self._counter.stop()
        finally:
            self._recount()
        if not replayed and flops <= 0:
            failed = "a FLOP formula failed on an operator of the step"
            none = "no matrix product ran between the step's first forward and its optimizer step"
            self._unavailable(failed if self._counter.failed else none)
        if flops > 0:
            self.flops_per_step = float(flops)
            readings = self._readings  # this step on counts (derived at scrape: no work a step)
            readings.flops_per_step, readings.flops_from_steps = self.flops_per_step, readings.steps
            self._write("flops", step=self._global_step(), flops_per_step=flops, dtype=self._dtype)
            self._fresh_flops = True
            self.due = float("-inf")  # close this block now: the next one holds MFU

    def no_forward_seen(self) -> None:
        """The counted step reached its optimizer step, but no forward of it was seen."""
        self.flops_step = _NEVER
        if self.flops_per_step is None:
            self._unavailable(
                "no forward of the attached module was seen in the step: the loop calls a "
                "submodule instead (a LightningModule whose training_step calls self.model(x) "
                "and never its own forward: give it a forward that does), or module.compile() "
                "traced the forward hooks away (attach to torch.compile(model) instead)"
            )

    def _replayed(self) -> int:
        """The kept forward, replayed on meta tensors, times the forwards of the step."""
        replay, self._replay = self._replay, None
        assert replay is not None  # optimizer_start checked it
        try:
            return count_on_meta(_unwrapped(self._model), *replay) * self._forwards
        except Exception as error:  # the model's own code on meta tensors: say why, once
            self._unavailable(
                "torch.compile is in use and the step's forward could not be replayed on meta "
                f"tensors ({type(error).__name__}: {str(error)[:200]})"
            )
            return 0

    def _unavailable(self, reason: str) -> None:
        """No FLOPs for this run: say why, once, in the log and the event log."""
        self._limiter.once(
            "flops-unavailable",
            logging.WARNING,
            "stabmon: FLOPs per step not counted: %s; set throughput.flops_per_step for MFU "
            "(logged once)",
            reason,
        )
        self._write("flops_unavailable", step=self._global_step(), reason=reason)

    def abandon(self, steps: int) -> None:
        """The counted step was skipped (GradScaler) or a named phase began: count the next."""
        if self.counting:
            self._counter.abandon()
            self._replay = None
            self._recount()
            self.flops_step = steps + 1

    def close(self) -> None:
        """At detach: a count still open (no optimizer step came) leaves the mode stack."""
        self._counter.abandon()
        self._replay = None
        self._recount()
        self.flops_step = _NEVER

    def _update_peak(self) -> None:
        """The configured peak on any device; else the table's, on a CUDA device only."""
        peak = self._config.peak_flops
        if peak is None and self._device_name is not None and self._dtype is not None:
            peak = peak_flops(self._device_name, self._dtype)
        self._readings.peak_flops = peak

    # --- blocks -------------------------------------------------------------------------------

    def _train_phases(self) -> dict[str, float]:
        phases = self._readings.phase_seconds
        return {phase: phases.get(phase, 0.0) for phase in PHASES}

    def step_end(self, now: float) -> None:
        """At a step end at or past ``due``: close the block, judge it, maybe write a record."""
        readings = self._readings
        self.due = now + self._config.slowdown_block_seconds
        steps = readings.steps - self._block_steps
        phases = self._train_phases()
        spent = {phase: phases[phase] - self._block_phases.get(phase, 0.0) for phase in PHASES}
        self._block_steps, self._block_phases = readings.steps, phases
        device = dict(readings.device_phase_seconds)  # CUDA events; empty on CPU
        cause = None
        if device:
            cause = {p: device.get(p, 0.0) - self._block_device.get(p, 0.0) for p in PHASES}
        self._block_device = device
        train_seconds = sum(spent.values())
        if self._fresh_flops:
            self._fresh_flops = False  # warm-up and the slower counted step: no MFU of theirs
        elif steps > 0 and self.flops_per_step is not None:
            peak = readings.peak_flops
            if peak and train_seconds > 0:
                readings.mfu = self.flops_per_step * steps / train_seconds / peak
        if steps > 0 and readings.steps > self._judged_from:
            self._judge(Block(now, steps, spent, cause))
        if now >= self._record_due:
            self.record(now)

    def _judge(self, block: Block) -> None:
        was = self._detector.active
        found = self._detector.update(block)
        self._readings.step_time_baseline = self._detector.baseline_seconds
        if found is not None:
            self._raise(found)
        elif was is not None and self._detector.active is None:
            self._readings.slowdown_active[was.phase] = 0
            self._write(
                "slowdown_end",
                step=self._last_step(),
                phase=was.phase,
                lasted_seconds=round(block.end - was.started, 3),
            )

    def _raise(self, found: Slowdown) -> None:
        self._readings.slowdown_active[found.phase] = 1
        step = self._last_step()  # the block's last step
        self._anomaly(
            "slowdown",
            step,
            f"steps have been {found.ratio - 1:.0%} slower for {found.held_seconds:.0f} s "
            f"({found.step_seconds * 1000:.1f} ms against a baseline of "
            f"{found.baseline_seconds * 1000:.1f} ms) at step {step}; {found.phase} grew most, "
            f"from {found.phase_baseline_seconds * 1000:.1f} to "
            f"{found.phase_step_seconds * 1000:.1f} ms per step",
            phase=found.phase,
            ratio=round(found.ratio, 4),
            step_seconds=found.step_seconds,
            baseline_seconds=found.baseline_seconds,
            phase_step_seconds=found.phase_step_seconds,
            phase_baseline_seconds=found.phase_baseline_seconds,
            held_seconds=round(found.held_seconds, 3),
        )

    def _last_step(self) -> int | None:
        """The index of the last step completed (block ends and records come between steps)."""
        completed = self._global_step()
        return completed - 1 if completed else None

    def restart(self, now: float) -> None:
        """After a resume (``load_state_dict``): a new baseline, after a new warm-up."""
        self._detector.reset()
        for phase in self._readings.slowdown_active:
            self._readings.slowdown_active[phase] = 0
        self._readings.step_time_baseline = None
        self._block_steps, self._block_phases = self._readings.steps, self._train_phases()
        self._block_device = dict(self._readings.device_phase_seconds)
        self._judged_from = self._readings.steps + self._config.slowdown_warmup_steps
        self.due = now + self._config.slowdown_block_seconds

    # --- records ------------------------------------------------------------------------------

    def record(self, now: float) -> None:
        """Write this process's running totals (goodput for ``stabmon report``)."""
        self._record_due = now + self._config.record_seconds
        readings = self._readings
        fields: dict[str, Any] = {
            "step": self._last_step(),  # the last step completed (docs/steps.md)
            "steps": readings.steps,  # completed in this process
            "uptime_seconds": round(now - self._started, 3),
            "phase_seconds": {k: round(v, 6) for k, v in dict(readings.phase_seconds).items()},
            "samples": readings.samples,
            "tokens": readings.tokens,
        }
        if self.flops_per_step is not None:
            fields["flops_per_step"] = self.flops_per_step
        if readings.mfu is not None:
            fields["mfu"] = round(readings.mfu, 5)
            fields["peak_flops"] = readings.peak_flops
            fields["dtype"] = self._dtype
        self._write("throughput", **fields)
