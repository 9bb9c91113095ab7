"""The allocator snapshot taken after a CUDA leak: bounded, once per process, always stopped."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stabmon.probes.memory_snapshot import MAX_ENTRIES, AllocatorSnapshots, SnapshotRecorder


class FakeCudaMemory:
    """Records the calls torch.cuda.memory would get; dumps write a small file."""

    def __init__(self, fail_dump: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_dump = fail_dump

    def _record_memory_history(self, enabled: Any = "all", max_entries: int = 0) -> None:
        self.calls.append(("record", None if enabled is None else max_entries))

    def _dump_snapshot(self, path: str) -> None:
        self.calls.append(("dump", path))
        if self.fail_dump:
            raise OSError(28, "No space left on device")
        Path(path).write_bytes(b"snapshot")


def test_records_for_the_configured_steps_then_dumps_once_and_stops(tmp_path: Path) -> None:
    memory = FakeCudaMemory()
    snapshots = SnapshotRecorder(3, tmp_path / "run", rank=2, memory=memory)
    assert snapshots.start("cuda:0", step=100)
    assert memory.calls == [("record", MAX_ENTRIES)]
    assert not snapshots.start("cuda:1", step=101)  # one recording at a time
    assert snapshots.step(101) is None and snapshots.step(102) is None
    device, path = snapshots.step(103) or ("", Path())
    assert device == "cuda:0"
    assert path == tmp_path / "run" / "rank-2.memory-snapshot-step103.pickle"
    assert path.read_bytes() == b"snapshot"
    assert memory.calls[1:] == [("dump", str(path)), ("record", None)]  # stopped after the dump
    assert not snapshots.recording
    assert not snapshots.start("cuda:0", step=500)  # once per process: the disk stays bounded


def test_off_by_default_and_stopped_even_when_the_dump_fails(tmp_path: Path) -> None:
    memory = FakeCudaMemory(fail_dump=True)
    assert not SnapshotRecorder(0, tmp_path, rank=0, memory=memory).start("cuda:0", step=1)
    assert memory.calls == []
    snapshots = SnapshotRecorder(1, tmp_path, rank=0, memory=memory)
    snapshots.start("cuda:0", step=1)
    with pytest.raises(OSError):  # the Monitor's guard counts it; recording must stop anyway
        snapshots.step(2)
    assert memory.calls[-1] == ("record", None)
    assert not snapshots.recording


class _Context:
    """The Context's step numbering and event record, as the plug-in uses them (docs/steps.md);
    the other members it reads are set by the test."""

    def __init__(self, **members: Any) -> None:
        self.__dict__.update(members)
        self.global_step = 0  # steps completed
        self.records: list[tuple[str, dict[str, Any]]] = []

    @property
    def last_step(self) -> int | None:
        return self.global_step - 1 if self.global_step else None

    def event(self, name: str, **fields: Any) -> None:
        self.records.append((name, fields))


def test_the_plug_in_records_for_the_configured_steps_after_the_epochs_last_step(
    tmp_path: Path,
) -> None:
    """epoch_end gets the epoch's last step index (99 after 100 steps); the window of 3
    steps still ends after step 102, when 103 steps have completed."""
    readings = SimpleNamespace(memory_leak_suspected={"cuda:0": True}, steps=100)
    recorder = _Context(
        readings=readings, rank=0, run_directory=tmp_path / "run",
        config=SimpleNamespace(memory_snapshot_steps=3),
    )  # fmt: skip
    plugin = AllocatorSnapshots(recorder)  # type: ignore[arg-type]  # the members it reads
    plugin.snapshots = SnapshotRecorder(3, tmp_path / "run", rank=0, memory=FakeCudaMemory())
    recorder.global_step = 100
    plugin.epoch_end(recorder.last_step)
    assert recorder.records == [("memory_snapshot_started", {"device": "cuda:0", "step": 99,
                                                              "steps": 3})]  # fmt: skip
    for completed in (101, 102, 103):
        recorder.global_step = completed
        plugin.step_end(completed)
    (_, snapshot) = recorder.records[-1]
    assert snapshot["step"] == 102
    assert snapshot["path"].endswith("rank-0.memory-snapshot-step103.pickle")
