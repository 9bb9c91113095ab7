"""stabmon.integrations._common: what every trainer adapter shares, through its own interface.

Batch counting runs on real DataLoaders; monitor state is saved and loaded through a
real Monitor (no exporter) and real files in tmp_path. PhaseSwitch needs only
``Monitor.phase``: a small recorder of entered and left phases stands in for it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import MonitorFactory
from helpers import tiny_model, train_step
from torch.utils.data import DataLoader, TensorDataset

from stabmon.integrations._common import (
    EpochBatches,
    PhaseSwitch,
    load_state,
    monitor_settings,
    save_state,
)


class Phases:
    """Monitor.phase's seam: records each block entered and left."""

    def __init__(self) -> None:
        self.log: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.log.append(f"enter {name}")
        yield
        self.log.append(f"exit {name}")


def _loader(
    samples: int, batch_size: int, drop_last: bool = False
) -> DataLoader[tuple[torch.Tensor, ...]]:
    return DataLoader(
        TensorDataset(torch.zeros(samples, 1)), batch_size=batch_size, drop_last=drop_last
    )


def test_phase_switch_keeps_one_phase_open_across_events() -> None:
    monitor = Phases()
    switch = PhaseSwitch(monitor)  # type: ignore[arg-type]
    switch.enter("eval")
    switch.enter("eval")  # staying in it: no new block
    switch.enter("checkpoint")
    switch.close()
    switch.close()
    assert monitor.log == ["enter eval", "exit eval", "enter checkpoint", "exit checkpoint"]
    assert switch.name is None


def test_epoch_batches_counts_the_short_last_batch_of_an_epoch() -> None:
    batches = EpochBatches.of(_loader(10, 4))
    assert batches is not None
    assert (batches.batch_size, batches.batches) == (4, 3)
    assert batches.samples(0, 2) == 8
    assert batches.samples(0, 3) == 10
    assert batches.samples(2, 1) == 2


def test_epoch_batches_counts_full_batches_when_the_last_is_dropped() -> None:
    batches = EpochBatches.of(_loader(10, 4, drop_last=True))
    assert batches is not None
    assert (batches.batches, batches.samples(0, 2)) == (2, 8)


def test_epoch_batches_reads_a_batch_sampler_when_the_loader_has_no_batch_size() -> None:
    dataset = TensorDataset(torch.zeros(7, 1))
    sampler = torch.utils.data.BatchSampler(
        torch.utils.data.SequentialSampler(dataset), batch_size=3, drop_last=False
    )
    batches = EpochBatches.of(DataLoader(dataset, batch_sampler=sampler))
    assert batches is not None
    assert batches.samples(0, 3) == 7


def test_epoch_batches_of_something_without_a_batch_size_is_none() -> None:
    assert EpochBatches.of(object()) is None
    assert EpochBatches.of(DataLoader(TensorDataset(torch.zeros(3, 1)), batch_size=None)) is None


def test_one_monitor_keeps_the_run_id_and_several_get_one_each() -> None:
    assert monitor_settings({"run_id": "exp"}, {"port": 0}, 0, 1) == {"port": 0}
    names = [monitor_settings({"run_id": "exp"}, {}, i, 2)["run_id"] for i in range(2)]
    assert names == ["exp-opt0", "exp-opt1"]


def test_a_long_run_id_is_cut_so_its_suffix_fits_the_limit() -> None:
    (run_id,) = [monitor_settings({"run_id": "r" * 128}, {}, 1, 2)["run_id"]]
    assert len(run_id) == 128 and run_id.endswith("-opt1")


def test_saved_monitor_state_resumes_step_numbering(attach: MonitorFactory, tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    first = attach(model, optimizer, serve_metrics=False, run_id="first")
    for _ in range(3):
        train_step(model, optimizer, first)
    path = tmp_path / "state" / "monitor.pt"
    save_state(first, path)
    saved_step = first.state_dict()["step"]
    first.detach()
    second = attach(model, optimizer, serve_metrics=False, run_id="second")
    assert load_state(second, path)
    assert second.state_dict()["step"] == saved_step == 3
    assert [p.name for p in path.parent.iterdir()] == ["monitor.pt"]


@pytest.mark.parametrize(
    "content",
    [None, b"", b"not a torch file", b"PK\x03\x04" + b"x" * 50],
    ids=["missing", "empty", "not-torch", "damaged-zip"],
)
def test_an_unusable_saved_state_is_a_warning_and_training_starts_over(
    attach: MonitorFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    content: bytes | None,
) -> None:
    model = tiny_model()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.01), serve_metrics=False)
    path = tmp_path / "monitor.pt"
    if content is not None:
        path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        assert not load_state(monitor, path)
    assert str(path) in caplog.text
    assert monitor.state_dict()["step"] == 0


def test_a_saved_state_with_any_one_byte_damaged_never_raises_out_of_load_state(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    """The resume callbacks call load_state outside any guard: a flipped bit must not end
    training (torch.load raises UnicodeDecodeError, KeyError, struct.error... for some)."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, serve_metrics=False)
    for _ in range(3):
        train_step(model, optimizer, monitor)
    good = tmp_path / "good.pt"
    save_state(monitor, good)
    data = good.read_bytes()
    damaged = tmp_path / "damaged.pt"
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(len(data), (300,), generator=generator).tolist()
    bits = torch.randint(8, (300,), generator=generator).tolist()
    for position, bit in zip(positions, bits, strict=True):
        flipped = bytearray(data)
        flipped[position] ^= 1 << bit
        damaged.write_bytes(bytes(flipped))
        assert load_state(monitor, damaged) in (True, False)  # returned: nothing raised


@pytest.mark.parametrize("leaks", [5, [(1,)], "x"])
def test_a_state_that_loads_but_is_malformed_is_a_warning_not_a_crash(
    attach: MonitorFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture, leaks: object
) -> None:
    model = tiny_model()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.01), serve_metrics=False)
    path = tmp_path / "monitor.pt"
    torch.save({**monitor.state_dict(), "leaks": leaks}, path)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        assert not load_state(monitor, path)
    assert "StabmonError" in caplog.text  # the Monitor's own refusal, not a stray TypeError
