"""stabmon.probes.batch_identity on real loops: a spike names the batches of its last steps,
by the DataLoader's sampler indices or the loop's own ids, in the event log and in the
rank's skip file, ready for a loop to skip them on resume."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MonitorFactory
from helpers import events
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset

import stabmon
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


def test_a_get_batch_loop_names_its_micro_batches_by_content_and_a_resumed_loop_skips_them(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    # nanoGPT's loop: get_batch() draws random rows, no DataLoader, no ids; two micro-batches
    # a step. The spike's batches are named by their samples' hashes, and a loop that
    # resumes finds the poisoned samples again with stabmon.sample_hashes.
    data = torch.randn(1000, 8, generator=torch.Generator().manual_seed(1))
    targets = data.sum(dim=1, keepdim=True)
    targets[[500, 501]] = 1e4  # two poisoned samples
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0, spike_warmup_steps=20)
    generator = torch.Generator().manual_seed(2)

    def get_batch(step: int, micro: int) -> torch.Tensor:
        if step == 40 and micro == 1:
            return torch.tensor([500, 3, 501, 7])
        return torch.randint(0, 1000, (4,), generator=generator) % 400  # never 500 or 501

    for step in range(44):
        for micro in range(2):
            rows = get_batch(step, micro)
            loss = torch.nn.functional.mse_loss(model(data[rows]), targets[rows]) / 2
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)
    monitor.detach()
    entries = json.loads((tmp_path / "test-run" / "rank-0.skip_batches.json").read_text())
    spiked = next(entry for entry in entries if entry["step"] == 40)
    assert len(spiked["hashes"]) == 8 and "indices" not in spiked  # both micro-batches
    skip = {value for entry in entries for value in entry["hashes"]}
    # On resume: hash each sample as the model receives it, and leave out those named.
    found = [row for row in range(1000) if stabmon.sample_hashes(data[row : row + 1])[0] in skip]
    assert {500, 501} <= set(found) and len(found) <= WINDOW_STEPS * 8


def test_a_batch_on_a_device_is_not_hashed_and_ids_given_stop_the_hashing(
    attach: MonitorFactory,
) -> None:
    model = torch.nn.Linear(8, 1)
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.0))
    identities = monitor._batches  # type: ignore[attr-defined]
    identities.forward(0, (torch.empty(4, 8, device="meta"),), {})  # not in host memory
    identities.forward(0, (torch.eye(4).to_sparse(),), {})  # not indexed so: left, no error
    assert not identities._hashes
    identities.forward(1, (), {"attention_mask": torch.ones(9, 3), "input_ids": torch.zeros(2, 3)})
    batch = {"batch_idx": torch.zeros(7), "img": torch.zeros(2, 3, 4, 4)}  # Ultralytics' batch
    identities.forward(2, (batch,), {})
    assert [(step, len(hashes)) for step, hashes in identities._hashes] == [(1, 2), (2, 2)]
    identities.forward(3, (torch.zeros(5000, 2),), {})  # a large tabular batch: rows bounded
    assert len(identities._hashes[-1][1]) == 4096
    identities.observed(3, [5, 6])
    identities.forward(4, (torch.zeros(2, 8),), {})
    assert [step for step, _ in identities._hashes] == [1, 2, 3]  # the loop names them now


# --- loaders with worker processes ------------------------------------------------------


class _Indexed(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Samples that carry their own index: the truth the skip file is checked against."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(size, 8, generator=generator)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        row = self.inputs[index]
        return row, row.sum().reshape(1), index


def _shuffled(dataset: _Indexed, **options: Any) -> DataLoader[Any]:
    return DataLoader(
        dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7),
        num_workers=2, multiprocessing_context="fork", **options,
    )  # fmt: skip


def _spike_run(
    attach: MonitorFactory, loader: DataLoader[Any], epochs: int, poisoned_step: int
) -> tuple[stabmon.Monitor, dict[int, list[int]]]:
    """A loop over ``loader`` whose batch at ``poisoned_step`` gets two huge targets; the
    truth: the indices each step's batch carried."""
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # a steady loss level
    monitor = attach(model, optimizer, judge_seconds=0, spike_warmup_steps=16)
    truth: dict[int, list[int]] = {}
    step = 0
    for _ in range(epochs):
        for inputs, targets, indices in monitor.track(loader):
            truth[step] = indices.tolist()
            if step == poisoned_step:
                targets[1:3] = 1e4
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.observe(loss=loss)
            step += 1
    monitor.detach()
    return monitor, truth


@pytest.mark.parametrize(
    ("persistent", "iterated_before"),
    [(False, False), (True, False), (True, True)],
    ids=["workers", "persistent-workers", "persistent-workers-iterated-before-track"],
)
def test_a_loader_with_worker_processes_names_the_poisoned_batch_exactly(
    attach: MonitorFactory, tmp_path: Path, persistent: bool, iterated_before: bool
) -> None:
    # 96 samples in batches of 8: 12 steps a pass. Step 24 is the third pass's first batch,
    # drawn inside iter(loader) (the iterator's constructor, or a persistent one's reset),
    # and the window before it the second pass's last batches, drawn as batches went out.
    dataset = _Indexed(96)
    loader, twin = (_shuffled(dataset, persistent_workers=persistent) for _ in range(2))
    if iterated_before:  # a persistent iterator track() has not seen
        for plain in (loader, twin):
            next(iter(plain))
    batch_sampler = loader.batch_sampler
    monitor, truth = _spike_run(attach, loader, epochs=4, poisoned_step=24)

    # What the loader yields is what it yields without stabmon, and its sampler is its own.
    plain = [indices.tolist() for _ in range(4) for _, _, indices in twin]
    assert [truth[step] for step in sorted(truth)] == plain
    assert loader.batch_sampler is batch_sampler
    records = events(monitor.event_log_path)
    (anomaly,) = [r for r in records if r["event"] == "anomaly" and r["kind"] == "loss_spike"]
    assert anomaly["step"] == 24
    entries = json.loads((tmp_path / "test-run" / "rank-0.skip_batches.json").read_text())
    named = {entry["step"]: entry["indices"] for entry in entries}
    assert sorted(named) == [21, 22, 23, 24]
    assert named == {step: truth[step] for step in named}  # every batch exactly


def test_a_spike_in_the_middle_of_a_pass_of_a_worker_loader_names_its_window_exactly(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    # The fifth pass's seventh batch: its window was drawn as earlier batches went out.
    dataset = _Indexed(96)
    loader, twin = _shuffled(dataset), _shuffled(dataset)
    monitor, truth = _spike_run(attach, loader, epochs=5, poisoned_step=12 * 4 + 6)
    entries = json.loads((tmp_path / "test-run" / "rank-0.skip_batches.json").read_text())
    named = {entry["step"]: entry["indices"] for entry in entries}
    assert sorted(named) == [51, 52, 53, 54]
    assert named == {step: truth[step] for step in named}
    assert [truth[s] for s in sorted(truth)] == [i.tolist() for _ in range(5) for *_, i in twin]


@pytest.mark.slow  # spawned workers import torch: ~30 s on a loaded 2-core machine
def test_spawned_workers_start_inside_iter_and_the_batches_are_still_named(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    # spawn (macOS's default): the workers start inside iter(loader), while the loader's
    # batch sampler is stabmon's read-through; they are sent the dataset, not the sampler.
    # Persistent: one spawn, not one a pass. The batch of step 24 is the third pass's first.
    loader = DataLoader(
        _Indexed(96), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7),
        num_workers=1, multiprocessing_context="spawn", persistent_workers=True,
    )  # fmt: skip
    _, truth = _spike_run(attach, loader, epochs=3, poisoned_step=24)
    entries = json.loads((tmp_path / "test-run" / "rank-0.skip_batches.json").read_text())
    assert {entry["step"]: entry["indices"] for entry in entries} == {
        step: truth[step] for step in (21, 22, 23, 24)
    }


# --- loaders whose batches cannot be named exactly: named nothing -------------------------


class _Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(0)
        for _ in range(48):
            row = torch.randn(8, generator=generator)
            yield row, row.sum().reshape(1)


class _Keyed(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset read by string keys, through a batch sampler of keys."""

    def __init__(self) -> None:
        self.rows = {f"key-{i}": torch.randn(8) for i in range(48)}

    def __getitem__(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[key], self.rows[key].sum().reshape(1)


class _KeyBatches(Sampler[list[str]]):
    def __iter__(self) -> Iterator[list[str]]:
        return iter([[f"key-{i + j}" for j in range(4)] for i in range(0, 48, 4)])

    def __len__(self) -> int:
        return 12


def _loaders() -> dict[str, DataLoader[Any]]:
    dataset = _Indexed(48)
    return {
        "in_order=False": DataLoader(
            dataset, batch_size=4, num_workers=2, multiprocessing_context="fork", in_order=False
        ),
        "IterableDataset": DataLoader(
            _Stream(), batch_size=4, num_workers=2, multiprocessing_context="fork"
        ),
        "batch sampler of keys": DataLoader(_Keyed(), batch_sampler=_KeyBatches()),
    }


@pytest.mark.parametrize("case", list(_loaders()))
def test_batches_no_index_names_exactly_are_named_by_content_never_by_a_wrong_index(
    attach: MonitorFactory, tmp_path: Path, case: str
) -> None:
    loader = _loaders()[case]
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0)
    seen = []
    for step, (inputs, targets, *_) in enumerate(monitor.track(loader)):
        seen.append(inputs)
        if step == 10:
            inputs[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)
    monitor.detach()
    assert len(seen) == len(list(_loaders()[case]))  # every batch, as the loader yields it
    records = events(monitor.event_log_path)
    assert any(r["event"] == "anomaly" and r["kind"] == "nonfinite_loss" for r in records)
    entries = json.loads((tmp_path / "test-run" / "rank-0.skip_batches.json").read_text())
    assert all("indices" not in entry for entry in entries)  # never a wrong index
    by_step = {entry["step"]: entry for entry in entries}
    assert by_step[10]["hashes"] == stabmon.sample_hashes(seen[10])  # the poisoned batch


class _Checkpointed(DataLoader[Any]):
    """A loader that saves its sampler's state as torchdata's StatefulDataLoader does: its
    iterator's index sampler and sampler iterator, as they are (a stand-in: torchdata is
    not a dependency; with torchdata 0.11 a tracked StatefulDataLoader resumed on other
    batches than an untracked one before the fix)."""

    def __iter__(self) -> Any:
        self.opened = super().__iter__()
        self.opened.state_dict = self.state_dict  # type: ignore[union-attr]  # its iterator's too
        return self.opened

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.opened._index_sampler, "drawing": self.opened._sampler_iter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_that_checkpoints_its_sampler_keeps_its_own_sampler_and_iterator(
    attach: MonitorFactory, workers: int
) -> None:
    import inspect

    loader = _Checkpointed(
        _Indexed(32), batch_size=4, shuffle=True, num_workers=workers,
        **({"multiprocessing_context": "fork"} if workers else {}),
    )  # fmt: skip
    model = torch.nn.Linear(8, 1)
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.0), judge_seconds=0)
    passes = iter(monitor.track(loader))
    next(passes)
    state = loader.state_dict()
    assert state["sampler"] is loader.batch_sampler  # what a checkpoint asks for its state
    assert inspect.isgenerator(state["drawing"])  # BatchSampler's own iterator
    del passes
    monitor.detach()


@pytest.mark.parametrize("workers", [0, 2])
def test_an_evaluation_pass_between_steps_is_no_training_batch_and_loses_none(
    attach: MonitorFactory, tmp_path: Path, workers: int
) -> None:
    # A validation loader tracked every 10 steps, mid-epoch: its batches are fetched with
    # the next training step's number but no optimizer step follows them; the training
    # pass goes on after it and its batches must still be named.
    options: dict[str, Any] = {"multiprocessing_context": "fork"} if workers else {}
    train = DataLoader(
        _Indexed(160), batch_size=8, shuffle=True, num_workers=workers,
        generator=torch.Generator().manual_seed(7), **options,
    )  # fmt: skip
    evaluation = DataLoader(_Indexed(24), batch_size=8, num_workers=workers, **options)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0)
    truth: dict[int, list[int]] = {}
    for step, (inputs, targets, indices) in enumerate(monitor.track(train)):
        if step and step % 10 == 0:
            with torch.no_grad():
                for held_out, _, _ in monitor.track(evaluation):
                    model(held_out)
        truth[step] = indices.tolist()
        if step == 12:
            inputs[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)
    monitor.detach()
    named = json.loads((tmp_path / "test-run" / "rank-0.skip_batches.json").read_text())
    at_12 = [entry for entry in named if entry["kind"] == "nonfinite_loss"]
    assert [(e["step"], e["indices"]) for e in at_12] == [
        (step, truth[step]) for step in range(12 - WINDOW_STEPS + 1, 13)
    ]


def test_batch_ids_on_the_device_are_refused_without_a_sync(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Fake CUDA (tests/fake_cuda.py: no GPU here): ids moved to the GPU with the batch were
    # read back element by element, a host-device sync each.
    from types import SimpleNamespace

    from fake_cuda import fake_cuda

    from stabmon.probes.batch_identity import BatchIdentities

    logged: list[tuple[Any, ...]] = []
    context: Any = SimpleNamespace(
        run_directory=tmp_path, rank=0, log=lambda *line: logged.append(line)
    )
    batches = BatchIdentities(context)
    with fake_cuda(monkeypatch) as cuda:
        batches.observed(3, torch.arange(512, device="cuda"))
        cuda.assert_clean()
    assert not batches._ring and logged and "integers on the host" in logged[0][2]
    batches.observed(4, torch.arange(5000))  # on the host: read at once, bounded
    batches.observed(5, range(10**9))  # any iterable: only the first MAX_INDICES are read
    assert [len(values) for _, _, values, _ in batches._ring] == [4096, 4096]


def test_a_validation_pass_left_before_its_end_is_no_training_batch(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    # Validation of two batches after every 10th optimizer step, by break: the pass never
    # ends, so only the training pass's next fetch, under the same step number, tells.
    train = DataLoader(
        _Indexed(160), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    evaluation = DataLoader(_Indexed(64), batch_size=8)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0)
    truth: dict[int, list[int]] = {}
    for step, (inputs, targets, indices) in enumerate(monitor.track(train)):
        truth[step] = indices.tolist()
        if step == 11:
            inputs[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)
        if step % 10 == 9:
            with torch.no_grad():
                for batch, (held_out, _, _) in enumerate(monitor.track(evaluation)):
                    model(held_out)
                    if batch == 1:
                        break
    monitor.detach()
    named = json.loads((tmp_path / "test-run" / "rank-0.skip_batches.json").read_text())
    at_11 = [(e["step"], e["indices"]) for e in named if e["kind"] == "nonfinite_loss"]
    assert at_11 == [(step, truth[step]) for step in range(11 - WINDOW_STEPS + 1, 12)]
