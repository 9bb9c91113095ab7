"""A CUDA allocator snapshot taken when the leak rule fires: where the growing memory comes from.

Knowing that device memory grows is half the answer; the other half is which
allocations keep growing. PyTorch's caching allocator can record every
allocation with its Python stack (``torch.cuda.memory._record_memory_history``)
and dump the record (``_dump_snapshot``) for https://pytorch.org/memory_viz.
Recording costs time on every allocation, so it is off by default
(``memory_snapshot_steps: 0``), starts only when the leak rule fires on a CUDA
device, lasts a bounded number of steps, and happens at most once per process,
so a long run never fills its disk with snapshots.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stabmon.shared.log import LOGGER

if TYPE_CHECKING:
    from stabmon.extension import Context

__all__ = ["AllocatorSnapshots", "SnapshotRecorder"]

#: Allocation events kept in the recording (PyTorch's own default is 100,000).
MAX_ENTRIES = 100_000


class SnapshotRecorder:
    """Records the allocator for ``steps`` steps after :meth:`start`, then dumps one snapshot."""

    def __init__(self, steps: int, directory: Path, rank: int, memory: Any = None) -> None:
        self._steps = steps
        self._directory = directory
        self._rank = rank
        self._memory = memory
        self._until: int | None = None
        #: Between start() and the dump: an attribute, read at every step by the Monitor.
        self.recording = False
        self._device = ""
        self.done = False

    def start(self, device: str, step: int) -> bool:
        """Begin recording (once per process); False when off, done or already recording."""
        if self._steps <= 0 or self.done or self.recording:
            return False
        self._cuda_memory()._record_memory_history(max_entries=MAX_ENTRIES)
        self._until = step + self._steps
        self._device = device
        self.recording = True
        return True

    def step(self, step: int) -> tuple[str, Path] | None:
        """At each step: once the window has passed, dump, stop, and return (device, path)."""
        if self._until is None or step < self._until:
            return None
        memory = self._cuda_memory()
        path = self._directory / f"rank-{self._rank}.memory-snapshot-step{step}.pickle"
        self._until, self.done, self.recording = None, True, False
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
            memory._dump_snapshot(str(path))
        finally:
            memory._record_memory_history(enabled=None)  # stop, whatever the dump did
        return self._device, path

    def _cuda_memory(self) -> Any:
        if self._memory is None:
            import torch.cuda.memory

            self._memory = torch.cuda.memory
        return self._memory


class AllocatorSnapshots:
    """Plug-in (:mod:`stabmon.extension`): starts a snapshot at an epoch end whose leak rule
    holds on a CUDA device (when ``memory_snapshot_steps`` is set), finishes it steps later."""

    component = "memory"

    def __init__(self, context: Context) -> None:
        self._readings = context.readings
        self._context = context
        self._steps = context.config.memory_snapshot_steps
        self.snapshots = SnapshotRecorder(self._steps, context.run_directory, context.rank)
        #: Every step while recording; otherwise never (epoch_end starts a recording).
        self.next_step = sys.maxsize

    def epoch_end(self, step: int | None) -> None:
        completed = 0 if step is None else step + 1  # the recorder counts steps completed
        for label, suspected in self._readings.memory_leak_suspected.items():
            if suspected and label.startswith("cuda") and self.snapshots.start(label, completed):
                self._context.event(
                    "memory_snapshot_started",
                    device=label,
                    step=self._context.last_step,
                    steps=self._steps,
                )
                self.next_step = self._readings.steps + 1
                return

    def step_end(self, steps: int) -> None:
        self.next_step = steps + 1
        step = self._context.global_step
        finished = self.snapshots.step(step)
        if finished is None:
            return
        self.next_step = sys.maxsize
        device, path = finished
        self._context.event(
            "memory_snapshot", device=device, step=self._context.last_step, path=str(path)
        )
        LOGGER.warning(
            "stabmon: CUDA allocator snapshot of %s written to %s; open it at "
            "https://pytorch.org/memory_viz to see which allocations grow",
            device,
            path,
        )
