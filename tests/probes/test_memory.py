"""stabmon.probes.memory: host RSS from the real /proc of real processes, the cgroup limit
from a fixture tree, and the device figures from a stand-in allocator.

This machine has no GPU, so the CUDA caching allocator cannot exist here: the
``allocator`` fixture stands in for the six ``torch.cuda`` calls the sampler makes
(memory_allocated, memory_reserved, max_memory_allocated, reset_peak_memory_stats,
utilization, get_device_properties), with figures the test sets.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from stabmon.pipeline.readings import DeviceMemory, Readings
from stabmon.probes.memory import (
    HOST,
    HostMemory,
    MemorySampler,
    cgroup_memory_limit,
    cuda_devices,
    device_label,
)

CUDA0 = torch.device("cuda", 0)


class Allocator:
    """Stand-in CUDA allocator statistics of one device (see the module docstring)."""

    def __init__(self) -> None:
        self.allocated = 3 * 2**30
        self.reserved = 4 * 2**30
        self.peak = 5 * 2**30
        self.total = 80 * 2**30
        self.busy_percent: int | None = 70
        self.resets = 0

    def reset(self, device: torch.device) -> None:
        self.resets += 1
        self.peak = self.allocated

    def utilization(self, device: torch.device) -> int:
        if self.busy_percent is None:
            raise RuntimeError("pynvml module not found")
        return self.busy_percent


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> Allocator:
    fake = Allocator()
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "memory_allocated", lambda device: fake.allocated)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device: fake.reserved)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device: fake.peak)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", fake.reset)
    monkeypatch.setattr(cuda, "utilization", fake.utilization)
    monkeypatch.setattr(
        cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=fake.total)
    )
    return fake


def test_host_memory_reads_the_rss_of_this_process() -> None:
    rss = HostMemory().rss_bytes()
    # The same /proc figure, read twice: it may move a little between the reads.
    assert abs(rss - psutil.Process().memory_info().rss) < 64 * 2**20
    assert rss > 64 * 2**20  # this process imported torch


def test_host_memory_reads_another_processes_rss_by_pid() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        rss = HostMemory(child.pid).rss_bytes()
        assert 0 < rss < psutil.Process().memory_info().rss  # a bare Python, not torch
    finally:
        child.communicate(b"")


def test_host_memory_limit_is_at_least_what_the_process_holds() -> None:
    host = HostMemory()
    assert host.limit_bytes() >= host.rss_bytes()


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"memory.max": "8589934592\n"}, 8 * 2**30),
        ({"memory.max": "max\n"}, None),
        ({"memory/memory.limit_in_bytes": "1073741824\n"}, 2**30),
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1's "no limit"
        ({}, None),
    ],
    ids=["v2-limit", "v2-max", "v1-limit", "v1-unlimited", "no-cgroup"],
)
def test_cgroup_memory_limit_reads_v2_then_v1(
    tmp_path: Path, files: dict[str, str], expected: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_memory_limit(tmp_path) == expected


def test_cuda_devices_lists_each_cuda_device_once_in_first_seen_order() -> None:
    tensors = [torch.empty(0, device="meta"), torch.empty(0)]
    fakes = [
        SimpleNamespace(device=torch.device("cuda", 1)),
        SimpleNamespace(device=CUDA0),
        SimpleNamespace(device=torch.device("cuda", 1)),
    ]
    assert cuda_devices([*tensors, *fakes]) == (torch.device("cuda", 1), CUDA0)  # type: ignore[list-item]
    assert cuda_devices(tensors) == ()


def test_device_label_names_a_device_as_the_metrics_do() -> None:
    assert device_label(CUDA0) == "cuda:0"
    assert device_label(torch.device("cpu")) == "cpu"


def test_memory_sampler_without_devices_samples_host_rss_only() -> None:
    readings = Readings(labels={})
    sampler = MemorySampler(readings, HostMemory(), lambda: ())
    sampler.sample()
    assert readings.host_rss is not None and readings.host_rss > 0
    assert readings.device_memory == {}
    samples, peaks = sampler.epoch_samples()
    assert set(samples) == {HOST} and peaks == {}
    assert set(sampler.trend_samples()) == {HOST}


def test_memory_sampler_records_each_devices_allocator_figures(allocator: Allocator) -> None:
    readings = Readings(labels={})
    sampler = MemorySampler(readings, None, lambda: (CUDA0,))
    sampler.sample()
    assert readings.device_memory == {"cuda:0": DeviceMemory(3 * 2**30, 4 * 2**30)}
    assert readings.device_memory_peak == {"cuda:0": 5 * 2**30}
    assert readings.device_utilization == {}  # no device time measured yet
    assert readings.host_rss is None
    assert sampler.limits() == {"cuda:0": 80.0 * 2**30}


def test_memory_sampler_starts_a_new_peak_window_at_epoch_end_only(allocator: Allocator) -> None:
    sampler = MemorySampler(Readings(labels={}), None, lambda: (CUDA0,))
    sampler.sample()
    assert allocator.resets == 0
    samples, peaks = sampler.epoch_samples()
    assert (samples, peaks) == ({"cuda:0": 3 * 2**30}, {"cuda:0": 5 * 2**30})
    assert allocator.resets == 1
    assert sampler.epoch_samples()[1] == {"cuda:0": 3 * 2**30}  # the new window's peak


def test_memory_sampler_utilization_is_the_devices_working_share_since_the_last_sample(
    allocator: Allocator,
) -> None:
    readings = Readings(labels={})
    sampler = MemorySampler(readings, None, lambda: (CUDA0,))
    for phase, seconds in (("forward", 0.3), ("backward", 0.5), ("data_wait", 0.2)):
        readings.add_device_phase_time(phase, seconds)
    sampler.sample()
    assert readings.device_utilization == {"cuda:0": pytest.approx(0.8)}

    readings.add_device_phase_time("optimizer", 0.1)  # the next interval: mostly starved
    readings.add_device_phase_time("data_wait", 0.9)
    sampler.sample()
    assert readings.device_utilization == {"cuda:0": pytest.approx(0.1)}


def test_memory_sampler_utilization_holds_through_an_interval_without_device_time(
    allocator: Allocator,
) -> None:
    readings = Readings(labels={})
    sampler = MemorySampler(readings, None, lambda: (CUDA0,))
    readings.add_device_phase_time("forward", 1.0)
    sampler.sample()
    for busy_percent in (0, 100, 0):  # NVML's point reading flickers; this figure does not
        allocator.busy_percent = busy_percent
        sampler.sample()  # no step finished on the device in between
        assert readings.device_utilization == {"cuda:0": 1.0}


def test_memory_sampler_reads_devices_at_each_sample(allocator: Allocator) -> None:
    devices: list[torch.device] = []
    readings = Readings(labels={})
    sampler = MemorySampler(readings, None, lambda: tuple(devices))
    sampler.sample()
    assert readings.device_memory == {}
    devices.append(CUDA0)  # the model moved to the GPU after attach
    sampler.sample()
    assert set(readings.device_memory) == {"cuda:0"}
