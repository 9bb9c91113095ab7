"""The Monitor: attach/detach lifecycle, wiring hooks → probes → readback → detectors → export.

``Monitor`` holds no math of its own. Hooks call the probes, whose device
results go through :class:`~stabmon.readback.Readback`; what comes back is
judged by the detectors and written into :class:`~stabmon.readings.Readings`
(scraped by the exporter) and, for anomalies and epochs, the event log. Every
hook body runs under the guard: nothing raised inside stabmon reaches the
training loop.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import torch
from prometheus_client import CollectorRegistry

from stabmon import __version__
from stabmon.background import PeriodicThread
from stabmon.config import Config, load_config
from stabmon.contract import INTERNAL_COMPONENTS
from stabmon.detectors.leak import LeakDetector
from stabmon.detectors.spike import SpikeDetector
from stabmon.detectors.stall import Heartbeat, StallReport, StallWatchdog
from stabmon.errors import StabmonError
from stabmon.export.collector import ReadingsCollector
from stabmon.export.event_log import EventLog
from stabmon.export.exporter import Exporter, candidate_ports
from stabmon.guard import Guard
from stabmon.hooks import HookSet, unwrap_model
from stabmon.log import LOGGER, LogLimiter
from stabmon.probes.amp import ScaleTracker
from stabmon.probes.device_timing import DeviceTimer
from stabmon.probes.environment import build_info, default_run_id, process_identity
from stabmon.probes.grads import GradProbe, GradSample
from stabmon.probes.memory import HostMemory, cuda_devices, device_label, sample_device
from stabmon.probes.timing import LoopTimer, timed_iteration
from stabmon.readback import Readback
from stabmon.readings import DeviceMemory, Readings
from stabmon.rundir import DEFAULT_RUN_DIR, RunPaths

__all__ = ["Monitor", "attach"]

T = TypeVar("T")

HOST = "host"
STATE_VERSION = 1
#: Named phases beyond this many share the label "other" (bounded cardinality).
MAX_NAMED_PHASES = 16
_PHASE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


@dataclass(frozen=True)
class _GradTag:
    step: int
    sample: GradSample


@dataclass(frozen=True)
class _ValueTag:
    kind: Literal["loss", "scale"]
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
    bad config and :class:`~stabmon.AlreadyAttachedError` when either object
    already has a Monitor; nothing else.

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
        self.config: Config = load_config(config, overrides)
        cfg = self.config
        identity = process_identity(os.environ)
        self.run_id: str = cfg.run_id or default_run_id(os.environ)
        self.rank: int = identity.rank
        self._limiter = LogLimiter(LOGGER, per_minute=cfg.log_rate_per_minute)
        self._guard = Guard(self._limiter, INTERNAL_COMPONENTS)
        self._hooks = HookSet(model, optimizer, owner=self)  # may raise AlreadyAttachedError
        self._detached = False

        self._readings = Readings(
            labels={"rank": str(self.rank), "run": self.run_id},
            build_info=build_info(__version__),
        )
        self._grads: GradProbe | None = None
        self._scale: ScaleTracker | None = None
        self._loss_spikes = SpikeDetector(
            threshold=cfg.spike_threshold, warmup=cfg.spike_warmup_steps, alpha=cfg.spike_ema_alpha
        )
        self._grad_spikes = SpikeDetector(
            threshold=cfg.spike_threshold,
            warmup=cfg.spike_warmup_steps,
            alpha=cfg.spike_ema_alpha,
            log_scale=True,
        )
        self._leaks: dict[str, LeakDetector] = {}
        self._explicit_epochs = False
        self._named_phases: set[str] = set()
        self._host_memory: HostMemory | None = None
        self._cuda_devices: tuple[torch.device, ...] = ()
        with self._guard.contain("grads"):
            self._grads = _build_grad_probe(model, optimizer, cfg)
            self._cuda_devices = cuda_devices(self._grads.params)
        with self._guard.contain("memory"):
            self._host_memory = HostMemory()
        if scaler is not None:
            self._scale = ScaleTracker(scaler)
            self._readings.amp_skipped_steps = 0

        self._readback: Readback[_GradTag | _ValueTag] = Readback()

        self._paths = RunPaths(
            root=Path(cfg.run_dir) if cfg.run_dir else DEFAULT_RUN_DIR,
            run_id=self.run_id,
            rank=self.rank,
        )
        self._events: EventLog | None = None
        if cfg.event_log:
            self._events = EventLog(
                self._paths.events,
                common={"run": self.run_id, "rank": self.rank},
                guard=self._guard,
            )

        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(ReadingsCollector(self._readings, self._guard.counts))
        self._exporter: Exporter | None = None
        if cfg.serve_metrics:
            ports = candidate_ports(
                cfg.port, identity.local_rank, identity.local_world_size, cfg.port_attempts
            )
            with self._guard.contain("exporter"):
                exporter = Exporter(
                    self._registry, address=cfg.address, ports=ports, limiter=self._limiter
                )
                if exporter.start():
                    self._exporter = exporter

        self._heartbeat = Heartbeat()
        self._device_timer: DeviceTimer | None = None
        if self._cuda_devices:
            self._device_timer = DeviceTimer(self._readings)
        self._timer = LoopTimer(
            self._readings,
            self._heartbeat,
            device_mark=self._device_timer.mark if self._device_timer else None,
        )
        self._watchdog = StallWatchdog(
            self._heartbeat,
            stall_seconds=cfg.stall_seconds,
            phase_stall_seconds=cfg.phase_stall_seconds,
            on_stall=self._on_stall,
            on_recover=self._on_stall_end,
        )
        self._threads = [
            PeriodicThread(
                "stabmon-watchdog",
                min(0.25, cfg.stall_seconds / 4) if cfg.stall_seconds else 0.25,
                self._watchdog.check,
                guard=self._guard,
                component="stall",
            ),
            PeriodicThread(
                "stabmon-sampler",
                cfg.sample_seconds,
                self._sample_now,
                guard=self._guard,
                component="memory",
            ),
        ]
        with self._guard.contain("memory"):
            self._sample_now()
        for thread in self._threads:
            thread.start()

        self._hooks.install(
            forward_pre=self._on_forward_pre,
            forward_post=self._on_forward_post,
            step_pre=self._on_step_pre,
            step_post=self._on_step_post,
        )
        self._write_event(
            "attach",
            environment=self._readings.build_info,
            config=cfg.to_dict(),
            pid=os.getpid(),
            metrics_url=self.metrics_url,
            parameters=len(self._grads.names) if self._grads else 0,
            module_groups=list(self._grads.groups) if self._grads else [],
        )
        LOGGER.info(
            "stabmon: attached (run %s, rank %d); metrics at %s; events in %s",
            self.run_id,
            self.rank,
            self.metrics_url or "(no exporter)",
            self._events.path if self._events and self._events.enabled else "(no event log)",
        )

    # --- public API ---------------------------------------------------------------------------

    @property
    def metrics_url(self) -> str | None:
        """The scrape URL of this Monitor's exporter, or None when it is not serving."""
        return self._exporter.url if self._exporter else None

    @property
    def event_log_path(self) -> Path | None:
        """The JSON-lines event log of this process, or None when it is off or unwritable."""
        return self._events.path if self._events and self._events.enabled else None

    @property
    def registry(self) -> CollectorRegistry:
        """The Monitor's own registry (no global state), e.g. for ``generate_latest``."""
        return self._registry

    def observe(self, loss: torch.Tensor | float | None = None) -> None:
        """Record this step's loss: a tensor (kept on device, read a step later) or a float."""
        if loss is None or self._detached:
            return
        try:
            step = self._readings.steps if self._timer.in_iteration else self._readings.steps - 1
            step = max(step, 0)
            if isinstance(loss, torch.Tensor):
                value = loss.detach()
                value = value.reshape(1) if value.numel() == 1 else value.float().mean().reshape(1)
                self._readback.submit(_ValueTag("loss", step), value.to(torch.float64))
                if value.device.type == "cpu":
                    self._consume(self._readback.poll())
            else:
                self._consume_loss(step, float(loss))
        except Exception as error:  # never break training
            self._guard.record("loss", error)

    def epoch_end(self) -> None:
        """Mark an epoch boundary: sample memory, judge drift and leaks, log a summary."""
        if self._detached:
            return
        self._explicit_epochs = True
        with self._guard.contain("memory"):
            self._close_epoch()

    def track(self, loader: Iterable[T]) -> Iterator[T]:
        """Iterate ``loader``, timing the input wait; its exhaustion marks an epoch end."""
        self._timer.loader_tracked = True
        self._explicit_epochs = True
        return timed_iteration(loader, self._loader_wait, self.epoch_end)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the time inside the block to the named phase (``eval``, ``checkpoint``).

        Inside it, the stall limit is ``phase_stall_seconds``, so long
        evaluations and checkpoints raise no false stall.
        """
        label = self._phase_label(name)
        try:
            self._timer.enter_named(label)
        except Exception as error:
            self._guard.record("hooks", error)
        try:
            yield
        finally:
            try:
                self._timer.exit_named()
            except Exception as error:
                self._guard.record("hooks", error)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must carry so a resumed run keeps its history and baselines."""
        readings = self._readings
        return {
            "version": STATE_VERSION,
            "run_id": self.run_id,
            "steps": readings.steps,
            "epoch": readings.epoch,
            "explicit_epochs": self._explicit_epochs,
            "nonfinite_grad_steps": readings.nonfinite_grad_steps,
            "nonfinite_losses": readings.nonfinite_losses,
            "amp_skipped_steps": readings.amp_skipped_steps,
            "anomalies": dict(readings.anomalies),
            "loss_spikes": self._loss_spikes.state_dict(),
            "grad_spikes": self._grad_spikes.state_dict(),
            "leaks": {device: leak.state_dict() for device, leak in self._leaks.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: step and epoch numbering, counts, baselines."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise StabmonError(
                f"not a stabmon Monitor state (expected a mapping with version {STATE_VERSION}); "
                "pass what Monitor.state_dict() returned"
            )
        try:
            readings = self._readings
            readings.steps = int(state["steps"])
            readings.epoch = int(state["epoch"])
            self._explicit_epochs = bool(state["explicit_epochs"])
            readings.nonfinite_grad_steps = int(state["nonfinite_grad_steps"])
            readings.nonfinite_losses = int(state["nonfinite_losses"])
            if readings.amp_skipped_steps is not None and state.get("amp_skipped_steps"):
                readings.amp_skipped_steps = int(state["amp_skipped_steps"])
                if self._scale is not None:
                    self._scale.skipped = readings.amp_skipped_steps
            readings.restore_counts(dict(state["anomalies"]).items())
            self._loss_spikes.load_state_dict(state["loss_spikes"])
            self._grad_spikes.load_state_dict(state["grad_spikes"])
            for device, leak_state in dict(state["leaks"]).items():
                self._leak_detector(device).load_state_dict(leak_state)
        except (KeyError, TypeError, ValueError) as error:
            raise StabmonError(
                f"malformed stabmon Monitor state: {error}; pass what Monitor.state_dict() returned"
            ) from error
        self._heartbeat.steps = self._readings.steps
        self._write_event("resume", step=self._readings.steps, epoch=self._readings.epoch)

    def detach(self) -> None:
        """Remove every hook, stop every thread and free the port; idempotent."""
        if self._detached:
            return
        self._detached = True
        self._hooks.remove()
        for thread in self._threads:
            thread.stop()
        with self._guard.contain("readback"):
            self._consume(self._readback.drain())  # slow path: waiting is fine at detach
        self._write_event("detach", step=self._readings.steps, epoch=self._readings.epoch)
        if self._events is not None:
            self._events.close()
        if self._exporter is not None:
            with self._guard.contain("exporter"):
                self._exporter.stop()
            self._exporter = None

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

    def _on_forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        try:
            self._timer.forward_start()
            if self._scale is not None:
                scale = self._scale.scale_tensor()
                if scale is not None:
                    self._readback.submit(_ValueTag("scale", self._readings.steps), scale)
        except Exception as error:
            self._guard.record("hooks", error)

    def _on_forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        try:
            self._timer.forward_end()
        except Exception as error:
            self._guard.record("hooks", error)

    def _on_step_pre(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        try:
            self._timer.optimizer_start()
        except Exception as error:
            self._guard.record("hooks", error)
        step = self._readings.steps
        if self._grads is None or step % self.config.measure_every:
            return
        try:
            sample = self._grads.measure()
            if sample is not None:
                self._readback.submit(_GradTag(step, sample), sample.packed)
        except Exception as error:
            self._guard.record("grads", error)

    def _on_step_post(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        try:
            self._timer.optimizer_end()
        except Exception as error:
            self._guard.record("hooks", error)
        try:
            self._consume(self._readback.poll())
            if self._device_timer is not None:
                self._device_timer.poll()
        except Exception as error:
            self._guard.record("readback", error)
        if not self._explicit_epochs and self._readings.steps % self.config.window_steps == 0:
            with self._guard.contain("memory"):
                self._close_epoch()

    def _loader_wait(self, seconds: float) -> None:
        try:
            self._timer.loader_wait(seconds)
        except Exception as error:
            self._guard.record("hooks", error)

    # --- host side: judging read-back values --------------------------------------------------

    def _consume(self, results: list[tuple[_GradTag | _ValueTag, list[float]]]) -> None:
        for tag, values in results:
            with self._guard.contain("detectors"):
                if isinstance(tag, _GradTag):
                    self._consume_grads(tag, values)
                elif tag.kind == "loss":
                    self._consume_loss(tag.step, values[0])
                else:
                    self._consume_scale(tag.step, values[0])

    def _consume_grads(self, tag: _GradTag, values: list[float]) -> None:
        if self._grads is None:  # a _GradTag exists only when the probe does
            return
        summary = self._grads.summarize(values, tag.sample.none_count, tag.sample.present)
        readings = self._readings
        readings.grad_norm = summary.total_norm
        readings.module_grad_norms = summary.group_norms
        readings.zero_grad_params = summary.zero_grad_params
        if summary.nonfinite:
            readings.nonfinite_grad_steps += 1
            offenders = self._grads.nonfinite_offenders(summary)
            self._anomaly(
                "nonfinite_grad",
                tag.step,
                f"non-finite gradient norm {summary.total_norm} at step {tag.step}; first "
                f"offending parameters: {', '.join(offenders) or 'unknown'}",
                grad_norm=summary.total_norm,
                parameters=offenders,
                modules=sorted({name.rsplit(".", 1)[0] for name in offenders}),
            )
            return
        spike = self._grad_spikes.update(summary.total_norm)
        if spike is not None and spike.run_length == 1:  # one incident, one anomaly
            self._anomaly(
                "grad_spike",
                tag.step,
                f"gradient norm spike at step {tag.step}: {spike.value:.4g} "
                f"(z={spike.zscore:.1f}, running mean {spike.mean:.4g})",
                grad_norm=spike.value,
                zscore=spike.zscore,
                mean=spike.mean,
            )

    def _consume_loss(self, step: int, value: float) -> None:
        readings = self._readings
        readings.loss = value
        if not math.isfinite(value):
            readings.nonfinite_losses += 1
            self._anomaly(
                "nonfinite_loss", step, f"non-finite loss {value} at step {step}", loss=value
            )
            return
        spike = self._loss_spikes.update(value)
        if spike is not None and spike.run_length == 1:  # one incident, one anomaly
            self._anomaly(
                "loss_spike",
                step,
                f"loss spike at step {step}: {spike.value:.4g} (z={spike.zscore:.1f}, "
                f"running mean {spike.mean:.4g})",
                loss=spike.value,
                zscore=spike.zscore,
                mean=spike.mean,
            )

    def _consume_scale(self, step: int, scale: float) -> None:
        if self._scale is None:  # a scale tag exists only with a scaler
            return
        skipped = self._scale.update(scale)
        self._readings.amp_loss_scale = scale
        if skipped:
            self._readings.amp_skipped_steps = self._scale.skipped
            self._write_event(
                "amp_skip",
                step=step,
                scale=scale,
                consecutive=self._scale.consecutive_skips,
            )

    def _anomaly(self, kind: str, step: int, message: str, **details: Any) -> None:
        self._readings.count_anomaly(kind)
        self._write_event("anomaly", kind=kind, step=step, epoch=self._readings.epoch, **details)
        self._limiter.limited(f"anomaly:{kind}", logging.WARNING, "stabmon: %s", message)

    # --- epochs and memory --------------------------------------------------------------------

    def _close_epoch(self) -> None:
        readings = self._readings
        epoch = readings.epoch
        self._consume(self._readback.poll())
        if self._device_timer is not None:
            self._device_timer.poll()
        samples: dict[str, float] = {}
        for device in self._cuda_devices:
            label = device_label(device)
            memory = sample_device(device, reset_peak=True)
            readings.device_memory_peak[label] = memory.peak_allocated
            readings.device_memory[label] = DeviceMemory(memory.allocated, memory.reserved)
            samples[label] = memory.allocated
        if self._host_memory is not None:
            rss = self._host_memory.rss_bytes()
            readings.host_rss = rss
            samples[HOST] = rss
        drift: dict[str, float | None] = {}
        for label, value in samples.items():
            verdict = self._leak_detector(label).update(epoch, value)
            readings.epoch_memory[label] = value
            drift[label] = verdict.drift
            if verdict.drift is not None:
                readings.memory_drift[label] = verdict.drift
            readings.memory_leak_suspected[label] = int(verdict.suspected)
            if verdict.newly_suspected:
                self._anomaly(
                    "memory_leak",
                    readings.steps,
                    f"memory on {label} grew more than {self.config.leak_threshold:.1%} in "
                    f"{self.config.leak_windows} consecutive windows of "
                    f"{self.config.leak_window_epochs} epoch(s); now {value / 2**20:.1f} MiB, "
                    f"drift {verdict.drift or 0.0:+.1%} against the baseline",
                    device=label,
                    bytes=value,
                    drift=verdict.drift,
                )
        self._write_event(
            "epoch",
            epoch=epoch,
            step=readings.steps,
            memory=samples,
            drift=drift,
            leak_suspected={label: bool(v) for label, v in readings.memory_leak_suspected.items()},
            grad_norm=readings.grad_norm,
            loss=readings.loss,
            anomalies={kind: n for kind, n in readings.anomalies.items() if n},
        )
        readings.epoch = epoch + 1

    def _leak_detector(self, label: str) -> LeakDetector:
        detector = self._leaks.get(label)
        if detector is None:
            cfg = self.config
            detector = LeakDetector(
                threshold=cfg.leak_threshold,
                windows=cfg.leak_windows,
                window_epochs=cfg.leak_window_epochs,
                warmup_epochs=cfg.leak_warmup_epochs,
            )
            self._leaks[label] = detector
        return detector

    def _sample_now(self) -> None:
        """Background sampler: memory now (host RSS, allocator figures)."""
        if self._host_memory is not None:
            self._readings.host_rss = self._host_memory.rss_bytes()
        for device in self._cuda_devices:
            memory = sample_device(device)
            self._readings.device_memory[device_label(device)] = DeviceMemory(
                memory.allocated, memory.reserved
            )

    # --- stalls (watchdog thread) -------------------------------------------------------------

    def _on_stall(self, report: StallReport) -> None:
        self._readings.stalled = 1
        self._readings.count_anomaly("stall")
        self._write_event(
            "anomaly",
            kind="stall",
            step=report.steps,
            epoch=self._readings.epoch,
            phase=report.phase,
            silent_seconds=round(report.silent_seconds, 3),
            limit_seconds=round(report.limit_seconds, 3),
            stacks=report.stacks,
        )
        self._limiter.limited(
            "anomaly:stall",
            logging.WARNING,
            "stabmon: no step completed for %.1f s (limit %.1f s) after step %d, in phase %r; "
            "thread stacks are in %s",
            report.silent_seconds,
            report.limit_seconds,
            report.steps,
            report.phase,
            self.event_log_path or "(no event log)",
        )

    def _on_stall_end(self, lasted: float) -> None:
        self._readings.stalled = 0
        self._write_event("stall_end", step=self._readings.steps, stalled_seconds=round(lasted, 3))
        LOGGER.info("stabmon: steps resumed after a stall of %.1f s", lasted)

    # --- helpers ------------------------------------------------------------------------------

    def _write_event(self, event: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(event, **fields)

    def _phase_label(self, name: str) -> str:
        if not isinstance(name, str) or not _PHASE_NAME.match(name):
            self._limiter.once(
                f"phase-name:{name!r}",
                logging.WARNING,
                "stabmon: phase name %r is not a short identifier ([A-Za-z_][A-Za-z0-9_]*, at "
                "most 64 characters); its time is counted as phase 'other'",
                name,
            )
            return "other"
        if name not in self._named_phases and len(self._named_phases) >= MAX_NAMED_PHASES:
            self._limiter.once(
                "phase-name:too-many",
                logging.WARNING,
                "stabmon: more than %d phase names; further ones are counted as phase 'other'",
                MAX_NAMED_PHASES,
            )
            return "other"
        self._named_phases.add(name)
        return name


def _build_grad_probe(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Config
) -> GradProbe:
    """A probe over the optimizer's trainable parameters, named from the (unwrapped) model."""
    names = {id(param): name for name, param in unwrap_model(model).named_parameters()}
    named: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            named.append((names.get(id(param), f"group{group_index}.param{param_index}"), param))
    return GradProbe(named, module_depth=config.module_depth, max_modules=config.max_modules)
