"""What user code can do to a Monitor without ever getting an exception back.

Already proved elsewhere, and named in README's "What stabmon survives":
a probe that raises (tests/test_monitor.py::test_a_probe_that_raises_is_contained_and_counted),
parameter groups added mid-run (::test_parameter_groups_added_mid_run_are_measured),
gradient accumulation (::test_gradient_accumulation_counts_optimizer_steps and
::test_long_gradient_accumulation_with_amp_loses_no_measurement) and steps skipped
by GradScaler (::test_grad_scaler_scale_and_skipped_steps). Here: forwards that
return unusual types, and a run nobody scrapes.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MonitorFactory
from helpers import LoopClock, events, scrape, train_step, value, wait_until


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


Pair = namedtuple("Pair", ["loss", "logits"])


class Shaped(torch.nn.Module):
    """A model whose forward returns ``kind`` of output; the loss is read from it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.body = torch.nn.Linear(8, 4)
        self.head = torch.nn.Linear(4, 1)
        self.last: torch.Tensor | None = None

    def forward(self, inputs: torch.Tensor) -> Any:
        logits = self.head(torch.relu(self.body(inputs)))
        loss = logits.pow(2).mean()
        self.last = loss
        return {
            "dict": {"loss": loss, "logits": logits, "extra": [None, "text", 3]},
            "tuple": (loss, (logits, None)),
            "namedtuple": Pair(loss, logits),
            "dataclass": Output(loss, logits),
            "none": None,
            "generator": (item for item in (loss,)),
            "string": "not a tensor",
        }[self.kind]


@pytest.mark.parametrize(
    "kind", ["dict", "tuple", "namedtuple", "dataclass", "none", "generator", "string"]
)
def test_forward_returning_unusual_types_is_measured_without_an_exception(
    attach: MonitorFactory, kind: str
) -> None:
    model = Shaped(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, judge_seconds=0)
    for _ in range(3):
        model(torch.randn(4, 8))
        assert model.last is not None
        model.last.backward()
        expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=model.last)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_steps_total") == 3
    assert value(samples, "stabmon_grad_norm") == pytest.approx(float(expected), rel=1e-5)
    assert value(samples, "stabmon_loss") == pytest.approx(float(model.last.detach()), rel=1e-5)
    errors = [v for (n, _), v in samples.items() if n == "stabmon_internal_errors_total"]
    assert errors and sum(errors) == 0


def _stall_recorded(path: Path | None) -> bool:
    return any(r["event"] == "anomaly" and r.get("kind") == "stall" for r in events(path))


def test_run_nobody_scrapes_keeps_every_anomaly_in_the_event_log(attach: MonitorFactory) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # Episodes of at most 5 quiet values: the NaN steps 25 and 40 are two incidents.
    clock = LoopClock()
    monitor = attach(model, optimizer, spike_warmup_steps=20, stall_seconds=0.3,
                     spike_episode_gap=5, clock=clock)  # fmt: skip
    batch = torch.randn(16, 8)
    nan_steps = {25, 40}
    for step in range(60):
        if step == 30:  # a corrupt batch
            loss = (model(batch * 50) - 1).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.observe(loss=loss)
            with torch.no_grad():
                for layer in (model[0], model[2]):
                    layer.reset_parameters()  # undo the spike's update
            continue
        train_step(model, optimizer, monitor, nan_grad=step in nan_steps)
        if step == 50:  # a stall: the loop hangs past its limit until the watchdog reports it
            clock.advance(1.0)
            wait_until(lambda: _stall_recorded(monitor.event_log_path), "the stall is recorded")
    monitor.detach()  # nothing ever scraped the endpoint
    records = [r for r in events(monitor.event_log_path) if r["event"] == "anomaly"]
    found = sorted((r["kind"], r["step"]) for r in records)
    assert ("nonfinite_grad", 25) in found and ("nonfinite_grad", 40) in found
    assert ("loss_spike", 30) in found and ("grad_spike", 30) in found
    assert ("stall", 51) in found
