"""``stabmon demo``: a CPU training run with faults injected on a schedule.

It shows every detector working on real data: a NaN gradient, a loss and
gradient spike, a host-memory leak and a stall, each injected at a known step
and each reported by the monitor (metrics, event log, log lines). It ends with
a summary that pairs every injected fault with what stabmon saw.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from stabmon.export.families import registry_sum
from stabmon.monitor import Monitor

__all__ = ["DemoPlan", "nan_step", "read_anomalies", "run_demo"]


@dataclass(frozen=True)
class DemoPlan:
    """When each fault happens; ``fast()`` is the same story compressed (480 steps, tests)."""

    epochs: int = 24
    steps_per_epoch: int = 50
    batch_wait_seconds: float = 0.02
    nan_step: int = 260
    spike_step: int = 420
    stall_step: int = 640
    stall_seconds: float = 6.0
    stall_limit_seconds: float = 3.0
    leak_from_epoch: int = 6
    leak_bytes_per_epoch: int = 48 * 2**20
    #: Run the loop on a simulated clock (each batch, step and the stall advance it by
    #: their nominal time), so a slow machine cannot stall a step past the limit: only
    #: the injected stall does. Off for people watching a dashboard; on for ``fast()``.
    simulated_clock: bool = False
    #: A step's nominal compute time on the simulated clock.
    step_seconds: float = 0.005

    @classmethod
    def fast(cls) -> DemoPlan:
        return cls(
            simulated_clock=True,
            epochs=16,
            steps_per_epoch=30,
            batch_wait_seconds=0.001,
            nan_step=100,
            spike_step=200,
            stall_step=330,
            stall_seconds=2.0,
            stall_limit_seconds=0.8,
            leak_from_epoch=5,
        )

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch


def run_demo(
    plan: DemoPlan,
    *,
    port: int = 9400,
    run_dir: str | None = None,
    serve_seconds: float = 0.0,
    out: TextIO = sys.stdout,
) -> dict[str, Any]:
    """Train, inject the faults of ``plan``, print a summary; return what was detected."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    # The model is tiny: intra-op threads add nothing but OpenMP's spin-waiting, which on a
    # busy machine made a 64x128 matmul take milliseconds (the demo's CPU went 4 s -> 24 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(plan, port=port, run_dir=run_dir, serve_seconds=serve_seconds, out=out)
    finally:
        torch.set_num_threads(threads)


def _run(
    plan: DemoPlan, *, port: int, run_dir: str | None, serve_seconds: float, out: TextIO
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 1),
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    clock = _SimulatedClock() if plan.simulated_clock else None
    with Monitor(model, optimizer, clock=clock, **_overrides(plan, port, run_dir)) as monitor:
        print(f"stabmon demo: metrics at {monitor.metrics_url or '(no exporter)'}", file=out)
        print(f"stabmon demo: event log {monitor.event_log_path}", file=out)
        print(_plan_text(plan), file=out)
        _train(plan, model, optimizer, monitor, clock, out)
        if serve_seconds > 0 and monitor.metrics_url:
            print(f"serving {monitor.metrics_url} for {serve_seconds:.0f} s more", file=out)
            # Idle on purpose, in a named phase as a real loop's eval or checkpoint would be:
            # its stall limit is phase_stall_seconds, so the wait is not reported as a stall.
            with monitor.phase("serve"):
                if clock is not None:
                    clock.advance(serve_seconds)
                time.sleep(serve_seconds)
        events_path = monitor.event_log_path
    detected = read_anomalies(events_path)
    print(_summary(plan, detected, events_path), file=out)
    return detected


def _overrides(plan: DemoPlan, port: int, run_dir: str | None) -> dict[str, Any]:
    """The demo's config: short warm-ups and leak windows, so a few minutes show every fault."""
    overrides: dict[str, Any] = {
        "port": port,
        "run_id": f"demo-{time.strftime('%Y%m%d-%H%M%S')}",
        "stall_seconds": plan.stall_limit_seconds,
        "spike_warmup_steps": 50,
        "leak_warmup_epochs": 2,
        "leak_window_epochs": 2,
        "leak_windows": 3,
        "leak_threshold": 0.03,
        "sample_seconds": 1.0,
        "sample_every": 10,  # a short run: more points for `stabmon report`
    }
    if run_dir is not None:
        overrides["run_dir"] = run_dir
    return overrides


def _train(
    plan: DemoPlan,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    monitor: Monitor,
    clock: _SimulatedClock | None,
    out: TextIO,
) -> None:
    """The training loop, with the plan's faults injected at their steps."""
    teacher = torch.nn.Linear(32, 1)
    leaked: list[torch.Tensor] = []
    step = 0
    for epoch in range(plan.epochs):
        for inputs in monitor.track(_batches(plan, epoch, clock)):
            targets = teacher(inputs).detach()
            if step == plan.spike_step:
                targets = targets * 200.0  # a corrupt batch: the loss and gradients spike
            if clock is not None:
                clock.advance(plan.step_seconds)
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            if step == plan.nan_step:
                nan_step(model, optimizer)
            else:
                optimizer.step()
            optimizer.zero_grad()
            monitor.observe(loss=loss)
            if step == plan.stall_step:  # a hung collective, a dead NFS mount
                _stall(monitor, plan.stall_seconds, clock)
            step += 1
        if epoch >= plan.leak_from_epoch:
            leaked.append(torch.ones(plan.leak_bytes_per_epoch // 4))  # a history list, kept
        print(
            f"epoch {epoch:2d}  steps {step:5d}  loss {float(loss.detach()):9.4f}  "
            f"anomalies {_anomaly_count(monitor)}",
            file=out,
        )


class _SimulatedClock:
    """The demo loop's clock when ``simulated_clock``: it moves only when the loop says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


#: How long the simulated stall waits, at most, for the watchdog thread to report it.
_STALL_REPORT_SECONDS = 60.0


def _stall(monitor: Monitor, seconds: float, clock: _SimulatedClock | None) -> None:
    """Block the training thread as a hang would: ``seconds`` of real time, or on the
    simulated clock, until the watchdog (a thread) has reported the stall."""
    if clock is None:
        time.sleep(seconds)
        return
    clock.advance(seconds)
    deadline = time.monotonic() + _STALL_REPORT_SECONDS
    while registry_sum(monitor.registry, "stabmon_stalled") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def _batches(
    plan: DemoPlan, epoch: int, clock: _SimulatedClock | None = None
) -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(epoch)
    for _ in range(plan.steps_per_epoch):
        time.sleep(plan.batch_wait_seconds)  # the input pipeline
        if clock is not None:
            clock.advance(plan.batch_wait_seconds)
        yield torch.randn(64, 32, generator=generator)


def nan_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A NaN reaches one gradient; the step is taken and undone, as GradScaler would skip it."""
    first = next(model.parameters())
    assert first.grad is not None
    first.grad.view(-1)[0] = float("nan")
    saved = [param.detach().clone() for param in model.parameters()]
    # Deep copies: the step updates momentum buffers in place.
    buffers = [
        {key: value.clone() for key, value in optimizer.state[param].items()}
        for param in model.parameters()
    ]
    optimizer.step()
    with torch.no_grad():
        for param, copy, state in zip(model.parameters(), saved, buffers, strict=True):
            param.copy_(copy)
            optimizer.state[param] = state


def _anomaly_count(monitor: Monitor) -> int:
    """Anomalies so far, read the way a scrape reads them."""
    return int(registry_sum(monitor.registry, "stabmon_anomalies_total"))


def read_anomalies(path: Path | None) -> dict[str, Any]:
    """The event log's anomaly records by kind (the soak benchmark reads them too)."""
    import json

    detected: dict[str, list[dict[str, Any]]] = {}
    if path is None:
        return detected
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "anomaly":
            detected.setdefault(record["kind"], []).append(record)
    return detected


def _plan_text(plan: DemoPlan) -> str:
    return (
        f"training {plan.total_steps} steps; faults: NaN gradient at step {plan.nan_step}, "
        f"corrupt batch at step {plan.spike_step}, {plan.stall_seconds:.0f} s stall after step "
        f"{plan.stall_step}, host memory leak of {plan.leak_bytes_per_epoch >> 20} MiB/epoch "
        f"from epoch {plan.leak_from_epoch}; each batch takes "
        f"{plan.batch_wait_seconds * 1e3:.0f} ms to load, longer than the tiny model trains "
        "on it (on a fast machine an input_starvation anomaly says so)"
    )


def _summary(plan: DemoPlan, detected: dict[str, Any], events_path: Path | None) -> str:
    expected = [
        ("nonfinite_grad", f"NaN gradient injected at step {plan.nan_step}"),
        ("loss_spike", f"corrupt batch at step {plan.spike_step}"),
        ("grad_spike", f"corrupt batch at step {plan.spike_step}"),
        ("stall", f"{plan.stall_seconds:.0f} s stall after step {plan.stall_step}"),
        ("memory_leak", f"leak of {plan.leak_bytes_per_epoch >> 20} MiB/epoch"),
    ]
    lines = ["", "stabmon demo summary", "--------------------"]

    def at(record: dict[str, Any]) -> str:
        return f"step {record.get('step')}, epoch {record.get('epoch')}"

    for kind, injected in expected:
        records = detected.get(kind, [])
        if records:
            lines.append(f"  detected  {kind:15s} at {at(records[0]):22s} <- {injected}")
        else:
            lines.append(f"  MISSED    {kind:15s} {'':25s} <- {injected}")
    # Every other anomaly too (a loss settling back after the corrupt batch spikes again):
    # the summary lists all that the event log holds, not only the first of each kind.
    first = {id(detected[kind][0]) for kind, _ in expected if detected.get(kind)}
    others = [r for records in detected.values() for r in records if id(r) not in first]
    for record in sorted(others, key=lambda r: (r.get("step") or 0, str(r.get("kind")))):
        lines.append(f"  also      {str(record.get('kind')):15s} at {at(record)}")
    total = sum(len(records) for records in detected.values())
    lines.append(f"{total} anomalies in the event log: {events_path}")
    return "\n".join(lines)
