"""The hang evidence every rank exports, read through a real scrape."""

from __future__ import annotations

import torch
from conftest import MonitorFactory
from helpers import scrape, tiny_model, value

from stabmon import contract


def test_hang_evidence_is_exported_from_attach_and_follows_the_loop_phase(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_collectives_total") == 0
    assert value(samples, "stabmon_collective_in_progress") == 0
    for state in contract.HANG_STATES:
        assert value(samples, "stabmon_hang_state", state=state) == 0, state
    assert value(samples, "stabmon_loop_phase", phase="startup") == 1
    assert value(samples, "stabmon_loop_phase", phase="forward") == 0

    model(torch.randn(4, *_input_shape(model))).sum().backward()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_loop_phase", phase="backward") == 1
    assert value(samples, "stabmon_loop_phase", phase="startup") == 0
    with monitor.phase("checkpoint"):
        samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_loop_phase", phase="checkpoint") == 1


def _input_shape(model: torch.nn.Module) -> tuple[int, ...]:
    first = next(module for module in model.modules() if isinstance(module, torch.nn.Linear))
    return (first.in_features,)
