"""Deferred device-to-host reads: the boundary that keeps the hot path sync-free.

Design
------
A probe computes its results on the device as one small 1-D tensor and hands it
to :meth:`Readback.submit` with a tag. For a CUDA tensor, ``submit`` starts a
``non_blocking`` copy into a pinned host buffer on the current stream and
records a CUDA event after it; nothing waits. :meth:`Readback.poll`, called at
the next step boundary, hands back every result whose event has completed
(``Event.query()`` never blocks), in the order they were submitted, typically
one step after. CPU tensors and host values are ready at once, or, submitted
behind a copy still in flight, as soon as it is. Other device types (MPS, XPU)
fall back to a blocking copy, which is documented as not sync-free.
:meth:`Readback.collect` does the device half alone (buffers come back every
step) for a caller that takes the results in batches.

Pinned buffers and events are pooled per size, so a long run allocates nothing
per step. If the device falls more than ``max_pending`` results behind (it
cannot in practice: CUDA's launch queue fills first), the oldest pending result
is dropped rather than waited for, and the drop is counted; host values queued
behind the copies count towards that bound too.

The Monitor calls these from the training thread and, when the loop has been
quiet for a while, from its judge thread; it holds one lock around every call,
so the queue itself takes none. Waiting for copies in flight is the caller's
loop (``poll`` until ``in_flight`` is 0), so that lock is never held across a wait.
"""

from __future__ import annotations

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
    slot: _Slot | None
    #: Host values queued behind copies still in flight (``slot`` is then None): results keep
    #: the order they were submitted in.
    values: list[float] | None = None


class Readback(Generic[Tag]):
    """Asynchronous copies of small device tensors, read a step later."""

    def __init__(self, *, max_pending: int = 64) -> None:
        self._max_pending = max_pending
        self._pending: deque[_Pending[Tag]] = deque()
        self._ready: list[tuple[Tag, list[float]]] = []
        self._free: dict[tuple[int, torch.dtype], list[_Slot]] = {}
        self.dropped = 0

    def submit(self, tag: Tag, values: torch.Tensor | list[float]) -> int:
        """Start reading ``values`` (a 1-D tensor) back to the host; returns at once.

        A list is values already on the host: ready at the next poll, like a CPU tensor,
        unless device copies submitted before it are still in flight (it then waits its
        turn). Returns how many results wait, in flight or ready for :meth:`poll`.
        """
        host: list[float]
        if isinstance(values, torch.Tensor):
            if values.is_cpu:  # a flag read; `.device.type` builds a device object every step
                host = values.tolist()  # host memory already: no device synchronisation
            elif not values.is_cuda:
                host = values.to("cpu").tolist()  # blocking fallback, see the docstring
            else:
                self._copy(tag, values)
                return len(self._pending) + len(self._ready)
        else:
            host = values
        if self._pending:
            self._queue(_Pending(tag, None, host))
        else:
            self._ready.append((tag, host))
        return len(self._pending) + len(self._ready)

    def _copy(self, tag: Tag, values: torch.Tensor) -> None:
        slot = self._take_slot(values)
        slot.host.copy_(values, non_blocking=True)
        # The copy runs on the source device's stream, which need not be the current device's;
        # an index, not ``values.device``: no device object to build and parse per copy.
        slot.event.record(torch.cuda.current_stream(values.get_device()))
        self._queue(_Pending(tag, slot))

    def _queue(self, pending: _Pending[Tag]) -> None:
        """Queue behind the copies in flight; past ``max_pending`` the oldest is dropped."""
        self._pending.append(pending)
        if len(self._pending) > self._max_pending:
            oldest = self._pending.popleft().slot
            if oldest is not None:
                self._release(oldest)
            self.dropped += 1

    def collect(self) -> int:
        """Read every completed copy into host memory, freeing its buffer; never blocks.

        Returns how many results are ready for :meth:`poll`. Called every step, so
        device buffers are recycled at once even when results are handed over in batches.
        """
        pending = self._pending
        ready = self._ready
        while pending:
            slot = pending[0].slot
            if slot is None:  # host values queued behind copies: their turn has come
                done = pending.popleft()
                ready.append((done.tag, done.values))  # type: ignore[arg-type]  # set with slot None
                continue
            if not slot.event.query():  # type: ignore[no-untyped-call]  # unannotated in torch
                break
            ready.append((pending.popleft().tag, slot.host.tolist()))  # pinned, copy done
            self._release(slot)
        return len(ready)

    def poll(self) -> list[tuple[Tag, list[float]]]:
        """Every completed result, oldest first; never blocks."""
        if self._pending:
            self.collect()
        ready = self._ready
        if ready:
            self._ready = []
        return ready  # empty: the same list, none allocated

    @property
    def pending(self) -> int:
        """Results submitted but not yet returned by ``poll``."""
        return len(self._pending) + len(self._ready)

    @property
    def in_flight(self) -> int:
        """Results still on their way to the host (device copies, and values queued behind)."""
        return len(self._pending)

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
