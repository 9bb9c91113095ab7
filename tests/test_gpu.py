"""On CUDA: the monitored step never synchronises, and the CUDA-only metrics appear.

Run with `pytest -m gpu` on a machine with a GPU; elsewhere these skip with "Requires: CUDA".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import MonitorFactory
from cuda_state import default_cuda_state, sync_debug_errors
from helpers import scrape, value
from torch.nn.utils import get_total_norm

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda_state_restored() -> Iterator[None]:
    """Each test starts and ends with sync-debug mode off: they pass in any order."""
    with default_cuda_state():
        yield


def _cuda_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    ).cuda()  # fmt: skip
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    inputs = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):  # bf16 needs no GradScaler
        loss = model(inputs).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def test_monitored_steps_never_synchronise_the_device(attach: MonitorFactory) -> None:
    # No GradScaler here: its own step() calls found_inf.item(), a sync of the user's making.
    model, optimizer = _cuda_model()
    monitor = attach(model, optimizer)
    for _ in range(5):  # warm-up: first-use allocations happen here
        monitor.observe(loss=_step(model, optimizer))
    torch.cuda.synchronize()
    with sync_debug_errors():
        for _ in range(300):
            monitor.observe(loss=_step(model, optimizer))
    torch.cuda.synchronize()
    monitor.epoch_end()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_steps_total") == 305
    assert value(samples, "stabmon_grad_norm") is not None
    # A sync inside a hook would raise there and be contained: every component must be clean.
    errors = {dict(lbl)["component"]: v for (n, lbl), v in samples.items()
              if n == "stabmon_internal_errors_total"}  # fmt: skip
    assert errors and not any(errors.values()), errors


def test_grad_norm_and_memory_metrics_on_cuda(attach: MonitorFactory) -> None:
    model, optimizer = _cuda_model()
    monitor = attach(model, optimizer)
    model(torch.randn(8, 256, device="cuda")).pow(2).mean().backward()
    expected = float(get_total_norm([p.grad for p in model.parameters()]))
    optimizer.step()
    torch.cuda.synchronize()  # the read-back copy has landed; epoch_end polls it
    monitor.epoch_end()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_grad_norm") == pytest.approx(expected, rel=1e-5)
    for name in ("stabmon_device_memory_allocated_bytes", "stabmon_device_memory_reserved_bytes",
                 "stabmon_device_memory_peak_bytes", "stabmon_epoch_memory_bytes"):  # fmt: skip
        assert value(samples, name, device="cuda:0") is not None, name
    assert value(samples, "stabmon_device_phase_seconds_total", phase="forward") > 0
    assert 0 <= value(samples, "stabmon_device_utilization_ratio", device="cuda:0") <= 1


def test_device_info_names_the_physical_gpu(attach: MonitorFactory) -> None:
    model, optimizer = _cuda_model()
    monitor = attach(model, optimizer)
    samples = scrape(monitor.metrics_url)
    (info,) = [dict(labels) for (name, labels) in samples if name == "stabmon_device_info"]
    properties = torch.cuda.get_device_properties(0)
    assert info["device"] == "cuda:0"
    assert info["uuid"].removeprefix("gpu-") == str(properties.uuid).lower().removeprefix("gpu-")
    assert info["name"] == properties.name
    assert info["pci_bus_id"].endswith(
        f"{properties.pci_bus_id:02X}:{properties.pci_device_id:02X}.0"
    )
    assert info["gpu"].isdigit() and info["driver_version"]  # NVML answers where a GPU is


def test_misplaced_cuda_input_is_reported_before_the_forward_fails(attach: MonitorFactory) -> None:
    model, optimizer = _cuda_model()
    monitor = attach(model, optimizer)
    inputs = torch.randn(4, 256)  # on the CPU; made before the mode, as a loader would
    torch.cuda.synchronize()  # nothing of the setup is left in flight under the mode
    with sync_debug_errors():  # the check reads metadata only
        with pytest.raises(RuntimeError):  # PyTorch's own error still follows in warn mode
            model(inputs)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_anomalies_total", kind="device_mismatch") == 1
    # Read from what the check recorded, not from when anything ran on the device.
    assert monitor.event_log_path is not None
    events = [json.loads(line) for line in Path(monitor.event_log_path).read_text().splitlines()]
    (mismatch,) = [e for e in events if e.get("kind") == "device_mismatch"]
    assert mismatch["what"] == "input args[0]" and mismatch["device"] == "cpu"


def test_a_cuda_leak_dumps_one_allocator_snapshot(attach: MonitorFactory) -> None:
    model, optimizer = _cuda_model()
    monitor = attach(
        model, optimizer, memory_snapshot_steps=2, leak_warmup_epochs=0, leak_windows=1,
        leak_window_epochs=1, leak_threshold=0.01,
    )  # fmt: skip
    hoard = []
    for _ in range(6):  # each epoch keeps 64 MiB more alive: a leak
        for _ in range(3):
            monitor.observe(loss=_step(model, optimizer))
        hoard.append(torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda"))
        monitor.epoch_end()
    assert monitor.event_log_path is not None
    events = [json.loads(line) for line in Path(monitor.event_log_path).read_text().splitlines()]
    (snapshot,) = [e for e in events if e["event"] == "memory_snapshot"]
    assert Path(snapshot["path"]).stat().st_size > 0
    samples = scrape(monitor.metrics_url)
    cache = value(samples, "stabmon_device_memory_cache_bytes", device="cuda:0")
    assert cache is not None and cache >= 0
