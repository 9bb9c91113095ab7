"""What stabmon asks of a CUDA device per training step, counted on the fake CUDA runtime.

Host time per step on a launch-bound GPU loop goes to CUDA calls (issue 38): event records
for the device phase timer, device-to-host copies of the results read back, and the
operators the measurements launch. Each is counted here, per step in steady state, against
the same loop without stabmon, so a change that adds one shows as a failing bound, and the
figures the note gives come from one command:
``python -m pytest -s tests/test_device_ops_per_step.py``. stabmon's Python calls a step on
the training thread are counted too (``sys.setprofile``: a count, not a time).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_cuda import FakeCuda, FakeEvent, fake_cuda
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import stabmon
from stabmon.probes import device_timing

STEPS = 40
STABMON_DIR = str(Path(stabmon.__file__).resolve().parent)
#: The loop clock stabmon is given advances this much a step: the 5 ms GPU step issue 38 sets
#: its bound for, so that judging (batched every judge_seconds) and the device timer's sampling
#: run as they would there, whatever a fake step takes on this machine.
STEP_SECONDS = 0.005


class LoopClock:
    """``step_seconds`` a step (:meth:`tick`), a microsecond more at each read (monotonic)."""

    def __init__(self, step_seconds: float = STEP_SECONDS) -> None:
        self.now = 1000.0
        self.step_seconds = step_seconds

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now

    def tick(self) -> None:
        self.now += self.step_seconds


class PythonCalls:
    """Calls of stabmon's Python functions on this thread (sys.setprofile: a count, not a time)."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> PythonCalls:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(STABMON_DIR):
            self.count += 1


class OperatorCount(TorchDispatchMode):
    """Counts every operator dispatched on a CUDA tensor (above the fake runtime)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Tensor lists too (_foreach_norm, stack); not prim.device, a property read on a real
        # tensor, which only a fake one dispatches.
        flat = [*args, *(kwargs or {}).values()]
        flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
        if func.namespace != "prim" and any(
            isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in flat
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64, device="cuda"), nn.ReLU(),
                                  nn.Linear(64, 8, device="cuda"))  # fmt: skip

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.body(inputs)
        return output


def _step(cuda: FakeCuda, model: _Net, optimizer: torch.optim.Optimizer,
          monitor: stabmon.Monitor | None) -> None:  # fmt: skip
    cuda.device.catch_up()  # the device runs a step behind the host
    loss = model(torch.randn(16, 32, device="cuda")).float().pow(2).mean()
    cuda.stand_in_backward(model.parameters())  # backward cannot run on a CPU build
    nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if monitor is not None:
        monitor.observe(loss=loss)


class RuntimeCalls:
    """Calls into the (fake) CUDA runtime that cost the host each time on a real one: event
    queries and ``elapsed_time`` reads, and ``current_stream()`` lookups."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts = {"event queries": 0, "elapsed_time reads": 0, "current_stream calls": 0}
        for name, what in (("query", "event queries"), ("elapsed_time", "elapsed_time reads")):
            monkeypatch.setattr(FakeEvent, name, self._counted(getattr(FakeEvent, name), what))
        monkeypatch.setattr(
            torch.cuda,
            "current_stream",
            self._counted(torch.cuda.current_stream, "current_stream calls"),
        )

    def _counted(self, function: Any, what: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[what] += 1
            return function(*args, **kwargs)

        return counted


def per_step(
    cuda: FakeCuda, run_dir: Path | None, calls: RuntimeCalls, step_seconds: float = STEP_SECONDS
) -> dict[str, float]:
    """Event records, device-to-host copies, CUDA operators and runtime calls per step, after
    warm-up."""
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = None
    clock = LoopClock(step_seconds)
    if run_dir is not None:
        monitor = stabmon.attach(model, optimizer, port=0, address="127.0.0.1",
                                 run_dir=str(run_dir), run_id="ops", clock=clock)  # fmt: skip
    try:
        for _ in range(10):
            _step(cuda, model, optimizer, monitor)
            clock.tick()
        device = cuda.device
        records, copies = device.recorded, device.copies
        before = dict(calls.counts)
        with OperatorCount() as operators:
            for _ in range(STEPS):
                _step(cuda, model, optimizer, monitor)
                clock.tick()
        counts = {
            "event records": (device.recorded - records) / STEPS,
            "device-to-host copies": (device.copies - copies) / STEPS,
            "CUDA operators": operators.count / STEPS,
            **{what: (calls.counts[what] - before[what]) / STEPS for what in before},
        }
        with PythonCalls() as python:  # the same steps again, without the operator count
            for _ in range(STEPS):
                _step(cuda, model, optimizer, monitor)
                clock.tick()
        return {**counts, "stabmon Python calls": python.count / STEPS}
    finally:
        cuda.device.catch_up()
        if monitor is not None:
            monitor.detach()


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    with fake_cuda(monkeypatch) as installed:
        yield installed


@pytest.fixture
def calls(cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> RuntimeCalls:
    # Fast steps whatever the machine's load: the device timer samples them (fake CUDA steps
    # on a loaded machine can take longer than its limit for timing every step).
    monkeypatch.setattr(device_timing, "LONG_STEP_SECONDS", float("inf"))
    return RuntimeCalls(monkeypatch)


def test_stabmon_adds_a_bounded_number_of_device_calls_per_step(
    cuda: FakeCuda, calls: RuntimeCalls, tmp_path: Path
) -> None:
    plain = per_step(cuda, None, calls)
    attached = per_step(cuda, tmp_path, calls)
    added = {what: attached[what] - plain[what] for what in plain}
    print(f"\nper step: plain {plain}; attached {attached}; added by stabmon {added}")

    assert plain["event records"] == 0 and plain["device-to-host copies"] == 0
    # Today (the figures issue 38 asks to cut, pinned so that none grows unnoticed): the
    # device phase timer times one fast step in eight (a window of five boundaries: about 0.5
    # a step over these steps, with its elapsed_time reads; it recorded four a step and read
    # five, 35 runtime calls a step in all with the copies' events, before it sampled); one
    # completion event a step for the read-back copies: the loss's copy records none, the next
    # step's gradient copy marks both (2 a step before); one copy for the gradient measurement
    # (the clip's norm rides with it) and one for observe()'s loss; five operators: the fused
    # norm and its stack, the loss's detach (a 0-d loss is copied as it is, no reshape: six
    # before), the two copies. stabmon's Python calls a step on the training thread: 107.7
    # before these cuts, 88.2 after (a loop clock of 5 ms a step: judged in batches; the loop
    # timer calls the device timer at no forward, backward or optimizer boundary between its
    # windows).
    assert added["event records"] <= 2
    assert added["elapsed_time reads"] <= 1
    assert added["event queries"] <= 6  # the judge thread may poll too, in a quiet moment
    assert added["current_stream calls"] <= 3
    assert added["device-to-host copies"] <= 2
    assert added["CUDA operators"] <= 5
    assert added["stabmon Python calls"] <= 95
    cuda.assert_clean()


def test_a_slow_steps_loss_keeps_its_own_read_back_event(
    cuda: FakeCuda, calls: RuntimeCalls, tmp_path: Path
) -> None:
    """Steps longer than judge_seconds (0.05 s): the loss's copy records its own event, so it
    is read as soon as its step is done on the device, not with the next step's gradients;
    steps of 5 ms share the gradient copy's event (one record a step fewer)."""
    fast = per_step(cuda, tmp_path / "fast", calls)
    slow = per_step(cuda, tmp_path / "slow", calls, step_seconds=0.2)
    assert slow["event records"] - fast["event records"] == 1.0
    cuda.assert_clean()
