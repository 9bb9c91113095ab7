"""The HTTP exporter: real sockets, real scrapes, busy ports that never reach training."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
from conftest import MonitorFactory
from helpers import scrape, tiny_model, train_step, value

from stabmon.export.exporter import candidate_ports


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port held by a listening socket for the duration of the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_candidate_ports_step_past_sibling_ranks() -> None:
    assert candidate_ports(9400, local_rank=1, local_world_size=4, attempts=3) == [9401, 9405, 9409]
    assert candidate_ports(0, local_rank=3, local_world_size=8, attempts=5) == [0]
    assert candidate_ports(65534, local_rank=0, local_world_size=1, attempts=4) == [65534, 65535]


def test_exporter_falls_back_when_its_port_is_busy(attach: MonitorFactory, busy_port: int) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, port=busy_port, port_attempts=4)
    assert monitor.metrics_url is not None
    assert f":{busy_port}/" not in monitor.metrics_url
    train_step(model, optimizer, monitor)
    assert value(scrape(monitor.metrics_url), "stabmon_steps_total") == 1


def test_training_goes_on_without_an_exporter_when_every_port_is_busy(
    attach: MonitorFactory, busy_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, port=busy_port, port_attempts=1)
    assert monitor.metrics_url is None
    for _ in range(3):
        train_step(model, optimizer, monitor)
    assert monitor.state_dict()["step"] == 3
    assert "could not bind the metrics exporter" in caplog.text


def test_training_goes_on_when_the_address_cannot_be_bound(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, address="203.0.113.7")  # TEST-NET-3: not on this host
    train_step(model, optimizer, monitor)
    assert monitor.metrics_url is None


def test_detach_frees_the_port(attach: MonitorFactory) -> None:
    monitor = attach(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1))
    url = monitor.metrics_url
    assert url is not None
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    monitor.detach()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))  # raises if the exporter still held it


def test_disabled_exporter_serves_nothing(attach: MonitorFactory) -> None:
    monitor = attach(
        tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1), serve_metrics=False
    )
    assert monitor.metrics_url is None
