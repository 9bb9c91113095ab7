"""On a GPU machine: the real daemon reads the real NVML and finds a CUDA training process on the
GPU that ``CUDA_VISIBLE_DEVICES`` pinned it to, and on no other.

Marked gpu (skipped with "Requires: CUDA" elsewhere) and slow (real processes); run by
``make gpu-check``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import scrape_until, start_announcing, unique_value

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

#: Trains a small CUDA model under stabmon until killed; prints "ready <metrics url>".
TRAINEE = """
import sys, torch, stabmon
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                            torch.nn.Linear(2048, 512)).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
hold = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # memory NVML can see
monitor = stabmon.attach(model, optimizer, port=0, address="127.0.0.1", run_dir=sys.argv[1],
                         run_id="gpu-check", sample_seconds=0.2)
print("ready", monitor.metrics_url, flush=True)
while True:
    loss = model(torch.randn(64, 512, device="cuda")).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    monitor.observe(loss=loss)
"""


def test_daemon_finds_a_pinned_training_process_on_its_gpu_through_real_nvml(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    pinned = (
        torch.cuda.device_count() - 1
    )  # the last GPU: not the default cuda:0 when there are two
    run_dir = str(tmp_path)
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": str(pinned)}
    trainee = subprocess.Popen(
        [sys.executable, "-c", TRAINEE, run_dir], stdout=subprocess.PIPE, text=True,
        start_new_session=True, env=environment,
    )  # fmt: skip
    processes.append(trainee)
    assert trainee.stdout is not None
    assert trainee.stdout.readline().startswith("ready"), "the CUDA trainee did not start"
    daemon, url = start_announcing(
        [sys.executable, "-m", "stabmon", "daemon", "--port", "0", "--address", "127.0.0.1",
         "--run-dir", run_dir, "--interval", "0.5"]
    )  # fmt: skip
    processes.append(daemon)

    def held(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> bool:
        used = unique_value(samples, "stabmon_process_gpu_memory_bytes", rank="0")
        return used is not None and used > 256 * 2**20

    samples = scrape_until(url, held, timeout=60.0)
    assert unique_value(samples, "stabmon_daemon_nvml_up") == 1
    assert unique_value(samples, "stabmon_process_up", rank="0", run="gpu-check") == 1
    for index in range(torch.cuda.device_count()):
        total = unique_value(samples, "stabmon_gpu_memory_total_bytes", gpu=str(index))
        assert total is not None and total > 0, f"no NVML memory total for GPU {index}"
    # CUDA's order need not be NVML's: the physical GPU is named by its UUID.
    expected = _bare_uuid(str(torch.cuda.get_device_properties(pinned).uuid))
    holders = {_bare_uuid(dict(labels)["uuid"]) for (name, labels), used in samples.items()
               if name == "stabmon_process_gpu_memory_bytes" and used > 0}  # fmt: skip
    assert holders == {expected}, f"expected memory on GPU {expected} only, got {holders}"
    assert unique_value(samples, "stabmon_anomalies_total", kind="device_mismatch") == 0


def _bare_uuid(uuid: str) -> str:
    return uuid.lower().removeprefix("gpu-")
