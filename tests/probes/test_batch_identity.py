"""stabmon.probes.batch_identity on real loops: a spike names the batches of its last steps,
by the DataLoader's sampler indices or the loop's own ids, in the event log and in the
rank's skip file, ready for a loop to skip them on resume."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import MonitorFactory
from helpers import events
from torch.utils.data import DataLoader, TensorDataset

from stabmon.probes.batch_identity import WINDOW_STEPS

POISONED = (37, 38)  # two samples with huge targets


def _dataset() -> TensorDataset:
    torch.manual_seed(0)
    inputs = torch.randn(400, 8)
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))


def test_a_loss_spike_from_two_poisoned_samples_names_their_indices_in_the_skip_file(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # a steady loss level
    monitor = attach(model, optimizer, judge_seconds=0, spike_warmup_steps=20)
    # Sequential order: batch b holds samples 4b..4b+3, so 37 and 38 are in batch 9; the
    # first pass warms the statistics up, and the samples are poisoned for the second.
    dataset = _dataset()
    loader = DataLoader(dataset, batch_size=4, shuffle=False)
    for epoch in range(2):
        if epoch == 1:
            for index in POISONED:
                dataset.tensors[1][index] = 1e4
        for inputs, targets in monitor.track(loader):
            per_sample = torch.nn.functional.mse_loss(model(inputs), targets, reduction="none")
            loss = per_sample.mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.observe(loss=loss, sample_losses=per_sample.mean(dim=1))
    monitor.detach()
    spike_step = 100 + 9  # the second pass's batch 9
    records = events(monitor.event_log_path)
    (anomaly,) = [r for r in records if r["event"] == "anomaly" and r["kind"] == "loss_spike"]
    assert anomaly["step"] == spike_step
    entries = json.loads((tmp_path / "test-run" / "rank-0.skip_batches.json").read_text())
    by_step = {entry["step"]: entry for entry in entries}
    assert by_step[spike_step]["indices"] == [36, 37, 38, 39]
    top = by_step[spike_step]["top_samples"]
    assert sorted(sample["index"] for sample in top[:2]) == list(POISONED)  # the highest losses
    assert top[0]["loss"] > 1e7 and top[0]["position"] in (1, 2)
    assert by_step[spike_step]["rank"] == 0
    assert by_step[spike_step]["kind"] in ("grad_spike", "loss_spike")  # whichever came first
    assert sorted(by_step) == list(range(spike_step - WINDOW_STEPS + 1, spike_step + 1))
    records = [r for r in events(monitor.event_log_path) if r["event"] == "batch_identities"]
    (record,) = [r for r in records if r["kind"] == "loss_spike"]
    assert record["step"] == spike_step
    assert [b["indices"] for b in record["batches"]][-1] == [36, 37, 38, 39]


def test_the_loops_own_batch_ids_name_the_batches_of_a_nonfinite_loss(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0)
    for step in range(12):
        inputs = torch.randn(4, 8)
        if step == 10:
            inputs[0, 0] = float("nan")
        loss = model(inputs).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss, batch_ids=[1000 + step])
    monitor.detach()
    entries = json.loads((tmp_path / "test-run" / "rank-0.skip_batches.json").read_text())
    assert {(e["step"], tuple(e["ids"]), e["kind"]) for e in entries} >= {
        (10, (1010,), "nonfinite_loss")
    }
