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

A copy that need not be read soon (the observed loss, submitted with
``fence=False``) records no event of its own: the next copy on the same stream records one
event that marks both done (stream order), one CUDA event record a step fewer; a
:meth:`Readback.collect` that finds a copy still unmarked records its event then, so none
waits for a copy that never comes (issue 38: the runtime calls a step). The price: the loss
is on the host once the next step's gradients are (after that step's backward on the device),
up to a step later than with its own event where the host runs ahead of the device; the
gradients, whose non-finite values matter first, are read as soon as before. The copy's stream
is kept for that later record, which the judge thread may make in a quiet loop (under the lock).

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
from typing import Any, Generic, TypeVar

import torch

__all__ = ["Readback"]

Tag = TypeVar("Tag")


class _Slot:
    """A pinned host buffer and its event, pooled by size; ``fence`` is the event that marks
    the copy into it done: its own once recorded, or a later copy's on the same stream (see
    the module docstring), None while neither is recorded."""

    __slots__ = ("event", "fence", "host", "stream")

    def __init__(self, host: torch.Tensor, event: Any) -> None:
        self.host = host
        self.event = event
        self.fence: Any = None
        self.stream: Any = None


class Readback(Generic[Tag]):
    """Asynchronous copies of small device tensors, read a step later."""

    def __init__(self, *, max_pending: int = 64) -> None:
        self._max_pending = max_pending
        #: In submission order: (tag, the slot of a device copy, or None and host values).
        self._pending: deque[tuple[Tag, _Slot | None, list[float] | None]] = deque()
        self._ready: list[tuple[Tag, list[float]]] = []
        self._free: dict[tuple[int, torch.dtype], list[_Slot]] = {}
        #: Copies whose event is not recorded yet (``fence=False``), oldest first.
        self._unfenced: list[_Slot] = []
        self.dropped = 0

    def submit(self, tag: Tag, values: torch.Tensor | list[float], fence: bool = True) -> int:
        """Start reading ``values`` (a 0-d or 1-D tensor) back to the host; returns at once.

        A list is values already on the host: ready at the next poll, like a CPU tensor,
        unless device copies submitted before it are still in flight (it then waits its
        turn). ``fence=False``: a CUDA copy's event waits for the next copy (or the next
        :meth:`collect`). Returns how many results wait, in flight or ready for :meth:`poll`.
        """
        host: list[float]
        if isinstance(values, torch.Tensor):
            if values.is_cpu:  # a flag read; `.device.type` builds a device object every step
                host = values.tolist()  # host memory already: no device synchronisation
            elif not values.is_cuda:
                host = values.to("cpu").tolist()  # blocking fallback, see the docstring
            else:
                self._copy(tag, values, fence)
                return len(self._pending) + len(self._ready)
        else:
            host = values
        pending = self._pending
        if pending:  # _queue, inlined: a clip's limit waits behind the step's copies
            pending.append((tag, None, host))
            if len(pending) > self._max_pending:
                self._drop_oldest()
        else:
            self._ready.append((tag, host))
        return len(self._pending) + len(self._ready)

    def _copy(self, tag: Tag, values: torch.Tensor, fence: bool) -> None:
        free = self._free.get((values.numel(), values.dtype))
        slot = free.pop() if free else self._new_slot(values)
        slot.host.copy_(values, non_blocking=True)  # a 0-d value fills the 1-element buffer
        # The copy runs on the source device's stream, which need not be the current device's;
        # an index, not ``values.device``: no device object to build and parse per copy.
        stream = torch.cuda.current_stream(values.get_device())
        unfenced = self._unfenced
        if fence:
            event = slot.event
            event.record(stream)
            slot.fence = event
            if unfenced:  # the copies before it on this stream are done when it is
                first = unfenced[0]
                if len(unfenced) == 1 and first.stream == stream:  # the loss's: the usual case
                    first.fence, first.stream = event, None
                    unfenced.clear()
                else:
                    self._fence(stream, event)
        else:
            slot.fence = None
            slot.stream = stream
            if unfenced and unfenced[-1].stream != stream:  # another stream: its own event
                self._fence()
            unfenced.append(slot)
        pending = self._pending  # _queue, inlined: every copy
        pending.append((tag, slot, None))
        if len(pending) > self._max_pending:
            self._drop_oldest()

    def _fence(self, stream: Any = None, event: Any = None) -> None:
        """Mark the unfenced copies done with ``event`` (recorded on ``stream`` after them)
        where they ran on that stream; on another stream, the last copy there records its own
        event, which marks the copies before it there too."""
        unfenced = self._unfenced
        marks: list[tuple[Any, Any]] = [] if event is None else [(stream, event)]
        for slot in reversed(unfenced):  # latest first: each stream's last copy marks the rest
            for on, mark in marks:
                if slot.stream == on:
                    slot.fence = mark
                    break
            else:
                slot.event.record(slot.stream)
                slot.fence = slot.event
                marks.append((slot.stream, slot.event))
            slot.stream = None
        unfenced.clear()

    def _drop_oldest(self) -> None:
        oldest = self._pending.popleft()[1]
        if oldest is not None:
            if oldest.fence is None:  # never marked: the others wait for a later copy
                self._unfenced.remove(oldest)
            self._release(oldest)
        self.dropped += 1

    def collect(self) -> int:
        """Read every completed copy into host memory, freeing its buffer; never blocks.

        Returns how many results are ready for :meth:`poll`. Called every step, so
        device buffers are recycled at once even when results are handed over in batches.
        Copies whose event waits for a later copy get one now.
        """
        pending = self._pending
        ready = self._ready
        if self._unfenced:
            self._fence()
        free = self._free
        passed = None  # an event found complete: the copies it marks need no query of their own
        while pending:
            tag, slot, values = pending[0]
            if slot is None:  # host values queued behind copies: their turn has come
                pending.popleft()
                ready.append((tag, values))  # type: ignore[arg-type]  # set with slot None
                continue
            fence = slot.fence
            if fence is not passed:
                if not fence.query():
                    break
                passed = fence
            pending.popleft()
            host = slot.host
            ready.append((tag, host.tolist()))  # pinned, copy done
            spare = free.get((host.numel(), host.dtype))  # _release, inlined: every copy
            if spare is None:
                self._release(slot)
            elif len(spare) < 4:
                slot.fence = None
                spare.append(slot)
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

    @staticmethod
    def _new_slot(values: torch.Tensor) -> _Slot:
        # 1-D whatever the value's shape (a 0-d loss too): tolist() gives a list of floats.
        host = torch.empty(values.numel(), dtype=values.dtype, pin_memory=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        return _Slot(host, event)

    def _release(self, slot: _Slot) -> None:
        slot.fence = slot.stream = None
        key = (slot.host.numel(), slot.host.dtype)
        free = self._free.setdefault(key, [])
        if len(free) < 4:  # a few spares per size; a changed layout must not hoard buffers
            free.append(slot)
