"""The flags every rank agrees on, and reading them on the host.

Each optimizer step every rank builds a small vector, one slot per acting kind (the step
it fired at, plus one; 0 when it did not), and the ranks take its element-wise maximum
with one all-reduce: a kind that fired on any rank fired on all, at the same step, so no
rank skips or stops alone (a rank that skipped alone would feed a stale replica into the
next all-reduce). The all-reduce is issued with ``async_op=True`` and waited on by the
device (NCCL makes the current stream wait; the host goes on), so the flag can gate the
step on the device.

Every rank must issue it at every optimizer step while a policy is configured, whatever
fails locally (a missing gradient, a failed measurement): a rank that left it out would
hang the others in the next collective. :func:`agree` therefore never raises before the
collective is issued; the caller builds a vector of zeros when its own checks fail.

:class:`HostCopy` reads the agreed vector a step later without a sync: the copy to host
memory is queued right after the all-reduce (pinned memory, ``non_blocking``) and an
event recorded; the next step reads it once the event has passed, which it has unless the
host runs more than a step ahead of the device (then it waits for that event only: the
previous step's work, never the current one's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["HostCopy", "agree", "world_size"]


def world_size() -> int:
    """The ranks that take part: the default group's size, 1 without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def agree(flags: torch.Tensor) -> torch.Tensor:
    """``flags`` maximised over every rank (in place), ordered before later device work.

    One all-reduce of a few float64 values on the default group; a single process returns
    ``flags`` as it is.
    """
    if world_size() > 1:
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        if work is not None:
            work.wait()  # NCCL: the current stream waits, not the host; gloo: done here
    return flags


class HostCopy:
    """An agreed vector on its way to the host, read at a later step.

    On CUDA the copy goes into one of two pinned buffers (used in turn: the one read at a
    step is never the one written at it), so no host memory is allocated a step.
    """

    __slots__ = ("_buffers", "_event", "_host", "step")

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        #: The step whose flags are on their way (None: nothing is).
        self.step: int | None = None

    def start(self, flags: torch.Tensor, step: int) -> None:
        """Queue the copy of ``flags`` (agreed at ``step``) to the host; never waits."""
        self.step = step
        if flags.device.type != "cuda":
            self._host, self._event = flags.detach().to("cpu", copy=True), None
            return
        buffers = self._buffers
        if not buffers or buffers[0].shape != flags.shape:
            buffers[:] = [torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
                          for _ in range(2)]  # fmt: skip
        buffers.reverse()  # the other one than last time
        host = buffers[0]
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
        event.record()
        self._host, self._event = host, event

    def take(self) -> tuple[int, list[float]] | None:
        """The step and values queued last (then nothing is queued), or None.

        Waits only when the device has not yet reached the copy, queued a step ago: when
        the host runs more than a step ahead of the device.
        """
        host, event, step = self._host, self._event, self.step
        if host is None or step is None:
            return None
        self._host, self._event, self.step = None, None, None
        if event is not None and not event.query():  # type: ignore[no-untyped-call]  # untyped in torch
            event.synchronize()
        values: list[float] = host.tolist()
        return step, values
