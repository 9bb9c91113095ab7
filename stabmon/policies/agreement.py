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

:class:`HostCopy` reads the agreed vector later without a sync: the copy to host memory is
queued right after the all-reduce (pinned memory, ``non_blocking``) and an event recorded.
Where the host acts on it (a kind judged late: every rank must act at the same step), the
next step reads it, waiting for that event when the host runs more than a step ahead of
the device (the previous step's work, never the current one's). Where it only reports
(a skip the device already made), it is read once its event has passed, and nothing waits.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MAX_IN_FLIGHT", "HostCopy", "agree", "all_attached", "answer_roll_call", "world_size"]


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


#: Seconds the first step waits, at most, for every rank to have attached (see
#: :func:`all_attached`); a job whose ranks step in lockstep never waits.
ROLL_CALL_WAIT = 30.0
#: Attaches with a policy in this process: ranks that attach alike count in the same key.
_generations = itertools.count()


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def answer_roll_call() -> str | None:
    """Count this rank among those with a policy (at attach), in the process group's
    store; the key, or None with one process or no store."""
    if world_size() <= 1:
        return None
    key = f"stabmon/on_anomaly/{next(_generations)}"
    try:
        _store().add(key, 1)
    except Exception:
        return None
    return key


def all_attached(key: str) -> bool:
    """At the first step, before the first agreement: whether every rank of the default
    group has a policy (a loop may attach stabmon on rank 0 alone; its all-reduce would
    wait for ranks that never issue one, or pair with DDP's). Read from the store, not a
    collective, waiting at most :data:`ROLL_CALL_WAIT` for ranks that attach later: under
    DDP or FSDP every rank attached before any reached its first step, so none waits."""
    world, deadline = world_size(), time.monotonic() + ROLL_CALL_WAIT
    while True:
        try:
            attached = int(_store().add(key, 0))
        except Exception:  # no store to read: as before, every rank is taken to be there
            return True
        if attached >= world:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


#: Copies left in flight when nothing needs them at a set step; beyond this many the oldest
#: is waited for (the host would be that many steps ahead of the device).
MAX_IN_FLIGHT = 8


class HostCopy:
    """Agreed vectors on their way to the host, read at later steps, oldest first.

    On CUDA each copy goes into a pinned buffer of a small pool, reused once read, so no host
    memory is allocated a step and a buffer being written is never read.
    """

    __slots__ = ("_free", "_pending")

    def __init__(self) -> None:
        self._pending: deque[tuple[int, torch.Tensor, Any]] = deque()
        self._free: list[torch.Tensor] = []

    def start(self, flags: torch.Tensor, step: int) -> None:
        """Queue the copy of ``flags`` (agreed at ``step``) to the host; never waits."""
        if flags.device.type != "cuda":
            self._pending.append((step, flags.detach().to("cpu", copy=True), None))
            return
        free = self._free
        host = free.pop() if free and free[-1].shape == flags.shape else None
        if host is None:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
        event.record()
        self._pending.append((step, host, event))

    def take(self, *, wait: bool) -> list[tuple[int, list[float]]]:
        """The steps and values of the copies on the host now, oldest first.

        ``wait``: every copy queued, waiting for those the device has not reached (the caller
        acts on them at a set step, the same on every rank); the wait is for the last step's
        copy, so only when the host runs more than a step ahead of the device. Without it,
        a copy still on its way stays queued (unless :data:`MAX_IN_FLIGHT` are).
        """
        taken: list[tuple[int, list[float]]] = []
        pending = self._pending
        while pending:
            step, host, event = pending[0]
            if event is not None and not event.query():
                if not wait and len(pending) < MAX_IN_FLIGHT:
                    break
                event.synchronize()
            pending.popleft()
            taken.append((step, host.tolist()))
            if event is not None:
                self._free.append(host)
        return taken
