"""Mixed precision and dead branches, end to end through a real Monitor and a real scrape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from conftest import MonitorFactory
from helpers import scrape, value

import stabmon


class TwoHeads(torch.nn.Module):
    """A shared trunk and two heads; ``aux_weight`` 0 cuts the aux head's loss branch off."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(8, 8)
        self.main = torch.nn.Linear(8, 1)
        self.aux = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.trunk(x)
        return self.main(hidden), self.aux(hidden)


def _events(monitor: stabmon.Monitor) -> list[dict[str, Any]]:
    assert monitor.event_log_path is not None
    lines = Path(monitor.event_log_path).read_text().splitlines()
    return [json.loads(line) for line in lines]


def _train(
    model: TwoHeads, optimizer: torch.optim.Optimizer, monitor: stabmon.Monitor, aux_weight: float
) -> None:
    main, aux = model(torch.randn(4, 8))
    loss = main.pow(2).mean() + aux_weight * aux.pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    monitor.observe(loss=loss)


def test_a_loss_branch_whose_gradient_is_always_zero_is_reported_by_module(
    attach: MonitorFactory,
) -> None:
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, dead_grad_steps=5, judge_seconds=0)
    for _ in range(4):
        _train(model, optimizer, monitor, aux_weight=0.0)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_dead_grad_params", module="aux") == 0  # not a whole window yet
    assert value(samples, "stabmon_zero_grad_params") == 2  # but the count already shows it
    _train(model, optimizer, monitor, aux_weight=0.0)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_dead_grad_params", module="aux") == 2
    assert value(samples, "stabmon_dead_grad_params", module="trunk") == 0
    (dead,) = [e for e in _events(monitor) if e["event"] == "dead_gradients"]
    assert dead["modules"] == ["aux.1"]
    assert dead["parameters"] == ["aux.1.weight", "aux.1.bias"]
    assert dead["step"] == 4

    _train(model, optimizer, monitor, aux_weight=1.0)  # the branch is wired back in
    assert value(scrape(monitor.metrics_url), "stabmon_dead_grad_params", module="aux") == 0
    assert [e["parameters"] for e in _events(monitor) if e["event"] == "gradients_revived"] == [
        ["aux.1.weight", "aux.1.bias"]
    ]


def test_gradient_norms_under_grad_scaler_are_unscaled(attach: MonitorFactory) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    monitor = attach(model, optimizer, scaler=scaler, judge_seconds=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # only to compute the reference here; scaler.step would do it
    reference = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    monitor.observe(loss=loss)
    samples = scrape(monitor.metrics_url)
    norm = value(samples, "stabmon_grad_norm")
    assert norm is not None and abs(norm - reference) <= 1e-6 * reference
    assert value(samples, "stabmon_amp_loss_scale") == 2.0**16


def test_a_run_of_skipped_amp_steps_is_one_nonfinite_anomaly(attach: MonitorFactory) -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = attach(model, optimizer, scaler=scaler, amp_skip_run=3, judge_seconds=0)

    def iteration(poison: bool) -> None:
        loss = model(torch.randn(2, 4)).pow(2).mean()
        if poison:
            loss = loss * float("inf")  # Inf gradients: GradScaler skips and halves its scale
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        monitor.observe(loss=loss)

    iteration(poison=False)
    iteration(poison=True)  # one isolated skip: GradScaler's normal scale search
    iteration(poison=False)
    for _ in range(5):
        iteration(poison=True)
    iteration(poison=False)  # flush the last scale read
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_amp_skipped_steps_total") == 6
    assert value(samples, "stabmon_anomalies_total", kind="nonfinite_grad") == 1
    (run,) = [e for e in _events(monitor) if e.get("source") == "amp_skip_run"]
    assert run["consecutive"] == 3
