"""stabmon/contract.py against the published contract, and what a fresh Monitor exports."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import pytest
import torch
from conftest import MonitorFactory
from helpers import scrape, tiny_model, value

import stabmon
from stabmon import contract

CONTRACT = Path(__file__).resolve().parents[2] / "shared" / "metrics-contract.md"
_ROW = re.compile(r"^\|\s*`(stabmon_[a-z_]+)`\s*\|\s*([a-z]+)[^|]*\|([^|]*)\|")  # "gauge = 1" too


def _published() -> dict[str, tuple[str, tuple[str, ...]]]:
    if not CONTRACT.exists():
        pytest.skip(f"the shared contract is not beside the checkout ({CONTRACT})")
    rows: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in CONTRACT.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            name, kind, labels = match.groups()
            rows[name] = (kind, tuple(re.findall(r"`([a-z_]+)`", labels)))
    return rows


def test_contract_module_matches_the_published_contract_row_for_row() -> None:
    ours = {
        m.name: (m.type, m.labels) for m in (*contract.TRAINING_METRICS, *contract.DAEMON_METRICS)
    }
    assert ours == _published()


def test_contract_anomaly_kinds_and_throttle_reasons_match_the_published_text() -> None:
    text = CONTRACT.read_text() if CONTRACT.exists() else pytest.skip("no shared contract")
    for kind in contract.PUBLISHED_ANOMALY_KINDS:
        assert f"`{kind}`" in text
    for reason in contract.THROTTLE_REASONS:
        assert f"`{reason}`" in text


def test_every_counter_and_known_child_is_exported_as_zero_from_attach(
    attach: MonitorFactory,
) -> None:
    monitor = attach(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1))
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_steps_total") == 0
    assert value(samples, "stabmon_nonfinite_grad_steps_total") == 0
    assert value(samples, "stabmon_nonfinite_loss_total") == 0
    for kind in contract.ANOMALY_KINDS:
        assert value(samples, "stabmon_anomalies_total", kind=kind) == 0, kind
    for component in contract.INTERNAL_COMPONENTS:
        assert value(samples, "stabmon_internal_errors_total", component=component) == 0
    for phase in contract.PHASES:
        assert value(samples, "stabmon_phase_seconds_total", phase=phase) == 0


def test_every_training_metric_is_exported_with_rank_and_run_labels(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    monitor = attach(model, optimizer, scaler=scaler, window_steps=2)
    for _ in range(4):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        monitor.observe(loss=loss)
    samples = scrape(monitor.metrics_url)
    exported = {name for name, _ in samples}
    cuda_only = {
        "stabmon_device_memory_allocated_bytes",
        "stabmon_device_memory_reserved_bytes",
        "stabmon_device_memory_peak_bytes",
    }
    for metric in contract.TRAINING_METRICS:
        if metric.name in cuda_only and not torch.cuda.is_available():
            continue
        names = (
            {metric.name, f"{metric.name}_count"} if metric.type == "histogram" else {metric.name}
        )
        assert names & exported, f"{metric.name} missing from the scrape"
    for (name, labels), _ in samples.items():
        if name.startswith("stabmon_"):
            assert {"rank", "run"} <= {key for key, _ in labels}, name


def test_contract_alert_names_match_the_published_contract() -> None:
    text = CONTRACT.read_text() if CONTRACT.exists() else pytest.skip("no shared contract")
    section = text.split("## Alert names", 1)[1].split("##", 1)[0]
    assert set(re.findall(r"`(Stabmon[A-Za-z]+)`", section)) == set(contract.ALERT_NAMES)


def test_build_info_fingerprints_this_environment(attach: MonitorFactory) -> None:
    monitor = attach(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1))
    [labels] = [
        dict(series) for name, series in scrape(monitor.metrics_url) if name == "stabmon_build_info"
    ]
    assert labels["stabmon_version"] == stabmon.__version__
    assert labels["torch_version"] == torch.__version__
    assert labels["python_version"] == platform.python_version()
    assert labels["cuda_version"] == (torch.version.cuda or "")
    if not torch.cuda.is_available():  # a CPU build: nothing of CUDA, cuDNN or NCCL to report
        assert (labels["cudnn_version"], labels["nccl_version"]) == ("", "")
    assert value(scrape(monitor.metrics_url), "stabmon_build_info", **labels) == 1
