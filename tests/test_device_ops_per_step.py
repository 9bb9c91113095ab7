"""What stabmon asks of a CUDA device per training step, counted on the fake CUDA runtime.

Host time per step on a launch-bound GPU loop goes to CUDA calls (issue 38): event records
for the device phase timer, device-to-host copies of the results read back, and the
operators the measurements launch. Each is counted here, per step in steady state, against
the same loop without stabmon, so a change that adds one shows as a failing bound, and the
figures the note gives come from one command:
``python -m pytest -s tests/test_device_ops_per_step.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_cuda import FakeCuda, fake_cuda
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import stabmon

STEPS = 40


class OperatorCount(TorchDispatchMode):
    """Counts every operator dispatched on a CUDA tensor (above the fake runtime)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat = [*args, *(kwargs or {}).values()]
        if any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in flat):
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


def per_step(cuda: FakeCuda, run_dir: Path | None) -> dict[str, float]:
    """Event records, device-to-host copies and CUDA operators per step, after warm-up."""
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = None
    if run_dir is not None:
        monitor = stabmon.attach(model, optimizer, port=0, address="127.0.0.1",
                                 run_dir=str(run_dir), run_id="ops")  # fmt: skip
    try:
        for _ in range(10):
            _step(cuda, model, optimizer, monitor)
        device = cuda.device
        records, copies = device.recorded, device.copies
        with OperatorCount() as operators:
            for _ in range(STEPS):
                _step(cuda, model, optimizer, monitor)
        return {
            "event records": (device.recorded - records) / STEPS,
            "device-to-host copies": (device.copies - copies) / STEPS,
            "CUDA operators": operators.count / STEPS,
        }
    finally:
        cuda.device.catch_up()
        if monitor is not None:
            monitor.detach()


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    with fake_cuda(monkeypatch) as installed:
        yield installed


def test_stabmon_adds_a_bounded_number_of_device_calls_per_step(
    cuda: FakeCuda, tmp_path: Path
) -> None:
    plain = per_step(cuda, None)
    attached = per_step(cuda, tmp_path)
    added = {what: attached[what] - plain[what] for what in plain}
    print(f"\nper step: plain {plain}; attached {attached}; added by stabmon {added}")

    assert plain["event records"] == 0 and plain["device-to-host copies"] == 0
    # Today (the figures issue 38 asks to cut, pinned so that none grows unnoticed): the
    # device phase timer's four boundaries (data wait, forward, backward, optimizer) and one
    # completion event per read-back copy; one copy for the gradient measurement (the clip's
    # norm rides with it) and one for observe()'s loss; a dozen small measurement kernels.
    assert added["event records"] <= 6
    assert added["device-to-host copies"] <= 2
    assert added["CUDA operators"] <= 12
    cuda.assert_clean()
