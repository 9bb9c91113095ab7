"""Collective sequence numbers from torch's flight recorder, read once a rank stalls.

Design
------
ProcessGroupNCCL keeps, per process group, the sequence numbers of the last
collective it enqueued, started (with ``TORCH_NCCL_ENABLE_TIMING``; else -1) and
completed, and dumps them with ``torch._C._distributed_c10d._dump_nccl_trace``
(older torch) or ``_dump_fr_trace`` (torch 2.9 on; gloo fills it too). The
counts come from the C++ side, so unlike stabmon's Python-level counter they
include DDP's gradient all-reduces, and with NCCL they say which rank is behind
even though every rank has returned from its (asynchronous) collective call.

Only the process-group status is asked for (no entries, no stacks): a small
dictionary. The stall responder reads it from its own thread, only while
stalled. :class:`FlightRecorder` is the tiny seam: ``dump`` is injected in tests
(a recorded-shaped dump), found in torch otherwise; any failure of the real
call or of the parse gives None, and the verdict falls back to the counter.

The dump keys each group by an id torch counts up for every group the process
ever made, and keeps a destroyed group's status: after ``destroy_process_group``
and a new ``init_process_group`` (an in-process restart), id 0 is the dead
group, and the live default group has a later id. So the default group is
found by its own collective count (``ProcessGroup._get_sequence_number_for_group``,
the number its latest enqueued collective carries): the lowest id whose last
enqueued collective has that number.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["FlightRecorder", "parse_dump", "torch_dump", "torch_sequence"]

#: The default process group's id in the dump: its sequence numbers are comparable across
#: every rank (subgroups have members of their own).
DEFAULT_GROUP = "0"
#: A pg_status dump is a few hundred bytes; anything far larger is not what we asked for.
MAX_DUMP_BYTES = 1 << 20


def parse_dump(
    dump: bytes | Mapping[str, Any], enqueued: int | None = None
) -> tuple[int, int, int] | None:
    """``(enqueued, started, completed)`` of the default group, or None when absent.

    ``dump`` is the pickled dictionary the torch call returns (or it unpickled);
    the numbers may be ints (pickle) or strings (the JSON dump). ``enqueued`` is
    the default group's own collective count: the group is the lowest id whose
    last enqueued collective has that number. Without it, id 0 (the first group
    the process made).
    """
    if isinstance(dump, bytes):
        if len(dump) > MAX_DUMP_BYTES:
            return None
        # Bytes our own process's torch just produced, never read from disk or a peer.
        dump = pickle.loads(dump)  # noqa: S301
    if not isinstance(dump, Mapping):
        return None
    status = dump.get("pg_status")
    if not isinstance(status, Mapping):
        return None
    if enqueued is None:
        return _numbers(status.get(DEFAULT_GROUP))
    ids = sorted(int(key) for key in status if isinstance(key, str) and key.isdecimal())
    for group_id in ids:
        numbers = _numbers(status[str(group_id)])
        if numbers is not None and numbers[0] == enqueued:
            return numbers
    return None


def _numbers(group: object) -> tuple[int, int, int] | None:
    if not isinstance(group, Mapping):
        return None
    numbers = []
    for key in ("last_enqueued_collective", "last_started_collective", "last_completed_collective"):
        value = group.get(key, -1)
        try:
            number = int(value)
        except (TypeError, ValueError):
            return None
        if isinstance(value, bool) or not -1 <= number < 2**63:
            return None
        numbers.append(number)
    if numbers[0] < 0:
        return None  # nothing enqueued: the recorder is not following this group
    return numbers[0], numbers[1], numbers[2]


def torch_dump() -> Callable[[], bytes] | None:
    """torch's flight-recorder dump of the process-group status, where torch has one."""
    try:
        import torch.distributed as distributed
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    if not distributed.is_available() or not distributed.is_initialized():
        return None
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None

    def status() -> bytes:
        return bytes(dump(False, False, True))  # no entries, no stacks, active only

    return status


def torch_sequence() -> Callable[[], int] | None:
    """The default group's own collective count, where torch has a default group."""
    try:
        import torch.distributed as distributed
    except ImportError:
        return None
    if not distributed.is_available() or not distributed.is_initialized():
        return None
    if not hasattr(distributed.group.WORLD, "_get_sequence_number_for_group"):
        return None

    def sequence() -> int:
        # Looked up at each read: a new init_process_group makes a new default group.
        return int(distributed.group.WORLD._get_sequence_number_for_group())  # type: ignore[union-attr]

    return sequence


class FlightRecorder:
    """The default group's collective sequence numbers, or None; never raises.

    ``dump`` and ``sequence`` are injected in tests; without ``sequence`` the
    default group is id 0.
    """

    def __init__(
        self,
        dump: Callable[[], bytes | Mapping[str, Any]] | None = None,
        sequence: Callable[[], int] | None = None,
    ) -> None:
        self._dump = dump
        self._sequence = sequence
        self._found = dump is not None
        #: The last failure, for the evidence ("ImportError: ..."); None while all is well.
        self.error: str | None = None

    def progress(self) -> tuple[int, int, int] | None:
        if not self._found:
            # The process group may come up after attach.
            self._dump, self._sequence = torch_dump(), torch_sequence()
            self._found = self._dump is not None
        if self._dump is None:
            return None
        try:
            dump = self._dump()
            enqueued = self._sequence() if self._sequence is not None else None
            return parse_dump(dump, enqueued)
        except Exception as error:  # noqa: BLE001 (a private torch API: contain whatever it does)
            self.error = f"{type(error).__name__}: {error}"[:200]
            return None
