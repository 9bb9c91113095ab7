"""DataLoader worker stacks: a real worker process blocked in its dataset names its frame."""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stabmon.probes.worker_stacks import (
    MAX_LOADERS,
    STACKS_SIGNAL,
    WorkerInit,
    WorkerStacks,
    innermost_frame,
)

BLOCK_LINE = 0


class Blocking(torch.utils.data.Dataset[torch.Tensor]):
    """Blocks from item 2 on while ``gate`` exists (a dead mount, until the test lets go)."""

    def __init__(self, gate: Path | None = None) -> None:
        self.gate = gate

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> torch.Tensor:
        if index >= 2 and self.gate is not None:
            (self.gate.parent / "entered").touch()
        while index >= 2 and self.gate is not None and self.gate.exists():
            time.sleep(0.05)  # BLOCKS
        return torch.zeros(2)


def _block_line() -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if "# BLOCKS" in line and "sleep" in line)


@pytest.fixture
def blocked(tmp_path: Path) -> Iterator[tuple[WorkerStacks, object]]:
    gate = tmp_path / "gate"
    gate.touch()
    loader = torch.utils.data.DataLoader(Blocking(gate), batch_size=2, num_workers=1,
                                         prefetch_factor=1)  # fmt: skip
    stacks = WorkerStacks(tmp_path / "run", rank=3)
    (tmp_path / "run").mkdir()
    stacks.install(loader)
    iterator = iter(loader)
    next(iterator)  # the worker registered at start, before its first batch
    waiting = threading.Thread(target=lambda: next(iterator), daemon=True)
    waiting.start()  # the main loop waiting on the worker, as in a stall
    deadline = time.monotonic() + 60
    while not (tmp_path / "entered").exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # until the worker is inside __getitem__'s wait (bounded, not timed)
    try:
        yield stacks, iterator
    finally:
        gate.unlink()  # the worker delivers; the iterator shuts its worker down cleanly
        waiting.join(timeout=30)
        iterator._shutdown_workers()  # type: ignore[attr-defined]


def test_worker_stacks_name_the_frame_a_blocked_loader_worker_waits_in(
    blocked: tuple[WorkerStacks, object], tmp_path: Path
) -> None:
    stacks, iterator = blocked
    (found,) = stacks.capture(iterator, timeout=10.0)
    assert found.worker == 0 and not found.idle
    assert found.where == f"test_worker_stacks.py:{_block_line()} in __getitem__"
    assert "most recent call first" in found.stack
    path = tmp_path / "run" / "rank-3.loader-0.worker-0.stacks"
    assert path.stat().st_mode & 0o777 == 0o600 and not path.is_symlink()


def test_worker_stacks_file_stays_bounded_over_repeated_captures(
    blocked: tuple[WorkerStacks, object], tmp_path: Path
) -> None:
    stacks, iterator = blocked
    sizes = []
    for _ in range(3):
        assert stacks.capture(iterator, timeout=10.0)
        sizes.append((tmp_path / "run" / "rank-3.loader-0.worker-0.stacks").stat().st_size)
    assert sizes[0] == sizes[1] == sizes[2]  # cut back to its header before each dump


def test_worker_stacks_never_signal_a_worker_whose_file_names_another_pid(
    blocked: tuple[WorkerStacks, object], tmp_path: Path
) -> None:
    stacks, iterator = blocked
    path = tmp_path / "run" / "rank-3.loader-0.worker-0.stacks"
    path.write_text("stabmon worker stacks pid=1\n")  # a previous worker's file
    assert stacks.capture(iterator, timeout=0.3) == []
    (process,) = iterator._workers  # type: ignore[attr-defined]
    assert process.exitcode is None  # not signalled: SIGUSR2 would have ended it


def test_worker_stacks_uninstall_gives_the_loader_its_own_init_back(tmp_path: Path) -> None:
    def own(worker_id: int) -> None:
        pass

    loader = torch.utils.data.DataLoader(Blocking(), num_workers=2, worker_init_fn=own)
    stacks = WorkerStacks(tmp_path, rank=0)
    stacks.install(loader)
    assert isinstance(loader.worker_init_fn, WorkerInit) and loader.worker_init_fn.original is own
    stacks.install(loader)  # tracked again next epoch: chained once
    assert loader.worker_init_fn.original is own
    stacks.uninstall()
    assert loader.worker_init_fn is own


def test_worker_stacks_leave_a_loader_without_workers_alone(tmp_path: Path) -> None:
    loader = torch.utils.data.DataLoader(Blocking(), num_workers=0)
    WorkerStacks(tmp_path, rank=0).install(loader)
    assert loader.worker_init_fn is None


def test_worker_init_refuses_a_planted_symlink_and_still_runs_the_users_init(
    tmp_path: Path,
) -> None:
    called: list[int] = []
    init = WorkerInit(str(tmp_path), "rank-0.loader-0", called.append)
    target = tmp_path / "victim"
    target.write_text("precious\n")
    planted = init.path(5).with_name(f"{init.path(5).name}.{os.getpid()}.tmp")
    planted.symlink_to(target)
    try:
        init(5)
    finally:
        faulthandler.unregister(STACKS_SIGNAL)
    assert called == [5]
    assert target.read_text() == "precious\n" and not init.path(5).exists()


def test_innermost_frame_reads_the_worker_loops_thread_most_recent_call_first() -> None:
    dump = (
        "stabmon worker stacks pid=7\n"
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        "\n"
        "Current thread 0x00007f00 (most recent call first):\n"
        '  File "/job/data.py", line 42 in __getitem__\n'
        '  File "/venv/torch/utils/data/_utils/fetch.py", line 52 in fetch\n'
        '  File "/venv/torch/utils/data/_utils/worker.py", line 349 in _worker_loop\n'
    )
    assert innermost_frame(dump) == "data.py:42 in __getitem__"


def test_worker_init_unregisters_the_dump_when_its_file_cannot_be_put_in_place(
    tmp_path: Path,
) -> None:
    init = WorkerInit(str(tmp_path), "rank-0.loader-0", None)
    init.path(5).mkdir()  # rename(2) of a file over a directory fails
    try:
        init(5)
    finally:
        registered = faulthandler.unregister(STACKS_SIGNAL)
    assert not registered  # else a later signal writes into whatever file reuses the fd


def test_worker_init_chains_a_signal_handler_the_worker_already_had(tmp_path: Path) -> None:
    received: list[int] = []
    previous = signal.signal(STACKS_SIGNAL, lambda signum, frame: received.append(signum))
    init = WorkerInit(str(tmp_path), "rank-0.loader-0", None)
    try:
        init(0)
        os.kill(os.getpid(), STACKS_SIGNAL)
        deadline = time.monotonic() + 30
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)  # the Python-level handler runs at the next bytecode boundary
    finally:
        faulthandler.unregister(STACKS_SIGNAL)
        signal.signal(STACKS_SIGNAL, previous)
    assert received == [STACKS_SIGNAL]  # submitit's handler, say, still runs
    assert "most recent call first" in init.path(0).read_text()  # and the stacks were dumped


def test_worker_stacks_reuse_the_slot_of_a_loader_built_anew_each_epoch(tmp_path: Path) -> None:
    stacks = WorkerStacks(tmp_path, rank=0)
    prefixes = []
    for _ in range(MAX_LOADERS + 2):
        loader = torch.utils.data.DataLoader(Blocking(), num_workers=1)
        stacks.install(loader)
        assert isinstance(loader.worker_init_fn, WorkerInit)
        prefixes.append(loader.worker_init_fn.prefix)
        del loader
        gc.collect()
    assert set(prefixes) == {"rank-0.loader-0"}  # the dead loader's slot, not a new one


def test_worker_stacks_keep_at_most_max_loaders_live_loaders(tmp_path: Path) -> None:
    stacks = WorkerStacks(tmp_path, rank=0)
    loaders = [
        torch.utils.data.DataLoader(Blocking(), num_workers=1) for _ in range(MAX_LOADERS + 1)
    ]
    for loader in loaders:
        stacks.install(loader)
    assert [isinstance(loader.worker_init_fn, WorkerInit) for loader in loaders] == [
        True
    ] * MAX_LOADERS + [False]


def test_two_worker_stacks_of_one_rank_in_one_process_name_their_files_apart(
    tmp_path: Path,
) -> None:
    first, second = WorkerStacks(tmp_path, rank=0), WorkerStacks(tmp_path, rank=0)
    loaders = [torch.utils.data.DataLoader(Blocking(), num_workers=1) for _ in range(2)]
    first.install(loaders[0])
    second.install(loaders[1])
    paths = {loader.worker_init_fn.path(0) for loader in loaders}
    first.uninstall()
    second.uninstall()
    assert len(paths) == 2
