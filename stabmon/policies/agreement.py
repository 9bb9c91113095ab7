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
event recorded; the next step waits for that event only, which the device passed long
before (it is the previous step's work, not the current one's).
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
    """An agreed vector on its way to the host, read at a later step without a sync."""

    __slots__ = ("_event", "_host", "step")

    def __init__(self, flags: torch.Tensor, step: int) -> None:
        #: The step whose flags these are.
        self.step = step
        self._event: torch.cuda.Event | None = None
        if flags.device.type == "cuda":
            self._host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self._host.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flags.detach().to("cpu", copy=True)

    def read(self) -> list[float]:
        """The values; waits for the copy (queued a step ago, so done or nearly)."""
        if self._event is not None:
            self._event.synchronize()
        values: list[float] = self._host.tolist()
        return values
