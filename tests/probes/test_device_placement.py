"""Device placement of parameters, buffers, optimizer state and inputs: real cpu and meta tensors.

This machine has no GPU; ``meta`` is a real second device (tensors with shape and
dtype but no storage), so every check here runs on real tensors. The CUDA
versions are in tests/test_gpu.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import MonitorFactory
from helpers import scrape, value

import stabmon
from stabmon.probes.placement import InputCheck, _misplaced, audit


class TwoInputs(torch.nn.Module):
    """Uses batch["x"]; carries batch["image_tag"] along unused (so a meta tag cannot fail it)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(
        self, batch: dict[str, torch.Tensor], scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(batch["x"]))
        return out


def _batch(tag_device: str = "cpu") -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, 4), "image_tag": torch.zeros(2, device=tag_device)}


def _anomalies(monitor: stabmon.Monitor) -> float | None:
    return value(scrape(monitor.metrics_url), "stabmon_anomalies_total", kind="device_mismatch")


def test_audit_finds_parameters_split_over_devices() -> None:
    model = TwoInputs()
    model.head.to("meta")
    (finding,) = audit(model, torch.optim.SGD(model.encoder.parameters(), lr=0.1))
    assert finding.what == "parameters split over devices"
    assert (finding.device, finding.expected) == ("meta", "cpu")
    assert finding.names == ("head.weight", "head.bias")


def test_audit_finds_a_stray_buffer() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model[1].running_mean = torch.zeros(4, device="meta")
    (finding,) = audit(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert (finding.what, finding.device, finding.names) == ("buffers", "meta", ("1.running_mean",))


def test_audit_finds_optimizer_state_on_another_device_but_not_cpu_step_scalars() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.state[model.weight] = {
        "step": torch.tensor(3.0),  # Adam keeps its step count as a CPU scalar: fine anywhere
        "exp_avg": torch.zeros(2, 4, device="meta"),
        "exp_avg_sq": torch.zeros(2, 4),
    }
    (finding,) = audit(model, optimizer)
    assert finding.what == "optimizer state"
    assert finding.names == ("weight['exp_avg']",)
    assert "cpu" in finding.expected


def test_input_check_names_the_argument_path_of_each_misplaced_tensor() -> None:
    model = TwoInputs()
    check = InputCheck(list(model.named_parameters()))

    @dataclass
    class Extra:
        mask: torch.Tensor

    found = check.check(
        (_batch("meta"), [torch.ones(1), torch.ones(1, device="meta")]),
        {"scale": torch.ones(3, device="meta"), "extra": Extra(torch.zeros(1, device="meta"))},
    )
    assert [(f.what, f.device, f.expected) for f in found] == [
        ("input args[0]['image_tag']", "meta", "cpu"),
        ("input args[1][1]", "meta", "cpu"),
        ("input scale", "meta", "cpu"),
        ("input extra.mask", "meta", "cpu"),
    ]
    assert check.check((_batch(),), {}) == []


def test_input_check_skips_models_on_meta_or_split_and_cpu_scalars() -> None:
    on_meta = torch.nn.Linear(2, 2, device="meta")
    assert InputCheck(list(on_meta.named_parameters())).check((torch.ones(2),), {}) == []
    assert not _misplaced(torch.tensor(1.0), torch.device("cuda", 0))  # a CPU scalar mixes in
    assert _misplaced(torch.ones(1), torch.device("cuda", 0))


def test_a_misplaced_input_is_reported_once_with_its_path_and_training_goes_on(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    model = TwoInputs()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer)
    assert _anomalies(monitor) == 0
    for _ in range(3):
        model(_batch("meta")).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe()
    assert _anomalies(monitor) == 1  # one finding, not one per step
    assert monitor.event_log_path is not None
    events = [json.loads(line) for line in Path(monitor.event_log_path).read_text().splitlines()]
    assert events[0]["event"] == "attach"
    (finding,) = [e for e in events if e.get("kind") == "device_mismatch"]
    assert finding["what"] == "input args[0]['image_tag']"
    assert (finding["device"], finding["expected"]) == ("meta", "cpu")


def test_raise_mode_raises_before_the_forward_runs(attach: MonitorFactory) -> None:
    model = TwoInputs()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.1), device_check="raise")
    with pytest.raises(
        stabmon.DeviceMismatchError, match=r"input args\[0\]\['image_tag'\] on meta"
    ):
        model(_batch("meta"))
    model(_batch())  # a correct batch passes
    assert monitor.state_dict()["step"] == 0


def test_raise_mode_refuses_to_attach_to_a_split_model(attach: MonitorFactory) -> None:
    model = TwoInputs()
    model.head.to("meta")
    with pytest.raises(stabmon.DeviceMismatchError, match="head.weight"):
        attach(model, torch.optim.SGD(model.parameters(), lr=0.1), device_check="raise")
    # Nothing was left attached: a new monitor with the check off attaches fine.
    attach(model, torch.optim.SGD(model.parameters(), lr=0.1), device_check="off")


def test_optimizer_state_loaded_after_attach_is_audited_at_the_first_step(
    attach: MonitorFactory,
) -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    monitor = attach(model, optimizer)
    optimizer.state[model.bias] = {
        "step": torch.tensor(1.0),
        "exp_avg": torch.zeros(2, device="meta"),
    }
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(Exception):  # noqa: B017 - Adam itself fails on the meta state: expected
        optimizer.step()
    assert _anomalies(monitor) == 1


def test_off_mode_checks_nothing(attach: MonitorFactory) -> None:
    model = TwoInputs()
    model.head.to("meta")
    monitor = attach(model, torch.optim.SGD(model.encoder.parameters(), lr=0.1), device_check="off")
    model.head.to_empty(device="cpu")
    model(_batch("meta"))
    assert _anomalies(monitor) == 0


@pytest.fixture
def two_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's two answers the LOCAL_RANK check reads, faked: available, two devices. No GPU
    here: the model stays on the CPU, and everything else about the Monitor is real."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.usefixtures("two_visible_gpus")
def test_a_local_rank_with_no_cuda_device_of_its_own_is_one_anomaly_at_attach(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torchrun started more ranks than this process sees GPUs.
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    model = TwoInputs()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _anomalies(monitor) == 1
    assert monitor.event_log_path is not None
    events = [json.loads(line) for line in Path(monitor.event_log_path).read_text().splitlines()]
    (finding,) = [e for e in events if e.get("kind") == "device_mismatch"]
    assert finding["what"] == "LOCAL_RANK"
    assert "cuda:3 does not exist" in finding["detail"]
    assert "CUDA_VISIBLE_DEVICES='0,1'" in finding["detail"]


@pytest.mark.usefixtures("two_visible_gpus")
def test_a_local_rank_within_the_visible_devices_is_no_anomaly(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    model = TwoInputs()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _anomalies(monitor) == 0
