"""Deferred device-to-host reads: the boundary that keeps the hot path sync-free.

Design
------
A probe computes its results on the device as one small 1-D tensor and hands it
to :meth:`Readback.submit` with a tag. For a CUDA tensor, ``submit`` starts a
``non_blocking`` copy into a pinned host buffer on the current stream and
records a CUDA event after it; nothing waits. :meth:`Readback.poll`, called at
the next step boundary, hands back every result whose event has completed
(``Event.query()`` never blocks), oldest first, so values arrive in step order,
typically one step after they were submitted. CPU tensors are already on the
host: they complete at once. Other device types (MPS, XPU) fall back to a
blocking copy, which is documented as not sync-free.

Only the training thread calls ``submit`` and ``poll``. Pinned buffers and
events are pooled per size, so a long run allocates nothing per step. If the
device falls more than ``max_pending`` results behind (it cannot in practice:
CUDA's launch queue fills first), the oldest pending result is dropped rather
than waited for, and the drop is counted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

__all__ = ["Readback"]

Tag = TypeVar("Tag")


@dataclass
class _Slot:
    host: torch.Tensor
    event: torch.cuda.Event


@dataclass
class _Pending(Generic[Tag]):
    tag: Tag
    slot: _Slot


class Readback(Generic[Tag]):
    """Asynchronous copies of small device tensors, read a step later."""

    def __init__(self, *, max_pending: int = 64) -> None:
        self._max_pending = max_pending
        self._pending: deque[_Pending[Tag]] = deque()
        self._ready: list[tuple[Tag, list[float]]] = []
        self._free: dict[tuple[int, torch.dtype], list[_Slot]] = {}
        self.dropped = 0

    def submit(self, tag: Tag, values: torch.Tensor | list[float]) -> None:
        """Start reading ``values`` (a 1-D tensor) back to the host; returns at once.

        A list is values already on the host: ready at the next poll, like a CPU tensor.
        """
        if isinstance(values, list):
            self._ready.append((tag, values))
            return
        if values.is_cpu:  # a flag read; `.device.type` builds a device object every step
            # Host memory already: reading it is no device synchronisation.
            self._ready.append((tag, values.tolist()))
            return
        if not values.is_cuda:
            self._ready.append((tag, values.to("cpu").tolist()))  # blocking fallback, see docstring
            return
        slot = self._take_slot(values)
        slot.host.copy_(values, non_blocking=True)
        # The copy runs on the source device's stream, which need not be the current device's.
        slot.event.record(torch.cuda.current_stream(values.device))
        self._pending.append(_Pending(tag, slot))
        if len(self._pending) > self._max_pending:
            self._release(self._pending.popleft().slot)
            self.dropped += 1

    def poll(self) -> list[tuple[Tag, list[float]]]:
        """Every completed result, oldest first; never blocks."""
        ready = self._ready
        if not self._pending:
            if ready:
                self._ready = []
            return ready  # nothing pending: no event to query, no list to allocate
        self._ready = []
        while self._pending and self._pending[0].slot.event.query():  # type: ignore[no-untyped-call]  # unannotated in torch
            done = self._pending.popleft()
            ready.append((done.tag, done.slot.host.tolist()))  # pinned host memory, copy finished
            self._release(done.slot)
        return ready

    def drain(self, timeout: float = 1.0) -> list[tuple[Tag, list[float]]]:
        """Wait up to ``timeout`` seconds for pending results; return what completed.

        The slow path of ``detach``: bounded, because a detach during a hung
        collective or a failed device must not hang the process too.
        """
        deadline = time.monotonic() + timeout
        ready = list(self.poll())  # poll() may hand back its own (empty) list
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.001)
            ready.extend(self.poll())
        return ready

    @property
    def pending(self) -> int:
        """Results submitted but not yet returned by ``poll``."""
        return len(self._pending) + len(self._ready)

    def _take_slot(self, values: torch.Tensor) -> _Slot:
        key = (values.numel(), values.dtype)
        free = self._free.get(key)
        if free:
            return free.pop()
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        return _Slot(host=host, event=event)

    def _release(self, slot: _Slot) -> None:
        key = (slot.host.numel(), slot.host.dtype)
        free = self._free.setdefault(key, [])
        if len(free) < 4:  # a few spares per size; a changed layout must not hoard buffers
            free.append(slot)
