"""A real short training with faults injected at known steps, and the CLI as a subprocess."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from helpers import LoopClock, tiny_model, train_step, wait_until

import stabmon
from stabmon.export.families import registry_sum

NAN_STEP = 30
SPIKE_STEP = 80
STALL_AFTER_STEP = 100
EPOCHS = 8
STEPS_PER_EPOCH = 15


@dataclass(frozen=True)
class FaultyRun:
    """The run directory of one real training, and the anomalies injected into it."""

    directory: Path
    events: Path
    #: (kind, step) of every injected fault, as stabmon must report it.
    injected: tuple[tuple[str, int], ...]


def train_with_faults(run_dir: Path) -> FaultyRun:
    """120 steps of a tiny model: a NaN gradient, a corrupt batch, a stall and a host leak."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    leaked: list[bytearray] = []
    # The loop's clock moves 10 ms a step and 4 s at the stall, whatever the machine's speed.
    clock = LoopClock()
    with stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(run_dir), run_id="faulty",
        sample_every=5, spike_warmup_steps=20, stall_seconds=2.0, leak_warmup_epochs=1,
        leak_window_epochs=1, leak_windows=2, leak_threshold=0.02, sample_seconds=0.2,
        clock=clock,
    ) as monitor:  # fmt: skip
        step = 0
        for _ in range(EPOCHS):
            for _ in range(STEPS_PER_EPOCH):
                clock.advance(0.01)
                if step == SPIKE_STEP:
                    spike(model, optimizer, monitor)
                else:
                    train_step(model, optimizer, monitor, nan_grad=step == NAN_STEP)
                if step == STALL_AFTER_STEP:  # past stall_seconds: the watchdog reports it
                    clock.advance(4.0)
                    wait_until(lambda: _stalled(monitor), "the watchdog reports the stall")
                step += 1
            leaked.append(bytearray(24 * 2**20))  # touched: RSS grows 24 MiB an epoch
            leaked[-1][::4096] = b"\1" * len(range(0, 24 * 2**20, 4096))
            monitor.epoch_end()
        events = monitor.event_log_path
    assert events is not None
    return FaultyRun(
        directory=events.parent,
        events=events,
        injected=(
            ("nonfinite_grad", NAN_STEP),
            ("grad_spike", SPIKE_STEP),
            ("loss_spike", SPIKE_STEP),
            ("stall", STALL_AFTER_STEP + 1),
            ("memory_leak", -1),  # at an epoch end; its step is whatever step that was
        ),
    )


def _stalled(monitor: stabmon.Monitor) -> bool:
    return registry_sum(monitor.registry, "stabmon_stalled") >= 1


def spike(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, monitor: stabmon.Monitor
) -> None:
    """A corrupt batch: inputs 1,000 times too large, so the loss and gradients spike.

    Its update is undone (as gradient clipping or a skipping scaler would limit it), so
    the run goes on clean instead of diverging into a stream of later anomalies.
    """
    saved = [param.detach().clone() for param in model.parameters()]
    loss = model(torch.randn(4, 8) * 1000).pow(2).mean()
    loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for param, copy in zip(model.parameters(), saved, strict=True):
            param.copy_(copy)
    monitor.observe(loss=loss)


def stabmon_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stabmon", *args], capture_output=True, text=True, timeout=timeout
    )
