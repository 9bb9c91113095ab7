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
found by its own sequence number (``ProcessGroup._get_sequence_number_for_group``,
the number its latest enqueued collective carries), read before and after the
dump: the one id whose last enqueued collective has it. Two such ids (a dead
group stopped at the same number) give None, not a guess. No such id (gloo's
send and recv count in the sequence number but not in the dump; a backend
without sequence numbers) falls back to id 0, the first group the process
made: right unless the process re-created its default group.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = ["FlightRecorder", "parse_dump", "torch_dump", "torch_sequence"]

#: The first group the process made: the default group unless the process re-created it. Only
#: the default group's numbers are comparable across every rank (subgroups have members of
#: their own).
FIRST_GROUP = "0"
#: A pg_status dump is a few hundred bytes; anything far larger is not what we asked for.
MAX_DUMP_BYTES = 1 << 20


def parse_dump(
    dump: bytes | Mapping[str, Any], default_group_sequence: int | None = None
) -> tuple[int, int, int] | None:
    """``(enqueued, started, completed)`` of the default group, or None when absent.

    ``dump`` is the pickled dictionary the torch call returns (or it unpickled);
    the numbers may be ints (pickle) or strings (the JSON dump).
    ``default_group_sequence`` picks the group as the module docstring says;
    without it, id 0.
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
    if default_group_sequence is not None:
        matching = [
            numbers
            for key, group in status.items()
            if isinstance(key, str) and key.isascii() and key.isdigit()
            and (numbers := _numbers(group)) is not None and numbers[0] == default_group_sequence
        ]  # fmt: skip
        if len(matching) == 1:
            return matching[0]
        if matching:
            return None  # a dead group stopped at the same number: no guess
    return _numbers(status.get(FIRST_GROUP))


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


def _initialized_distributed() -> ModuleType | None:
    """``torch.distributed`` once a default process group is up; else None."""
    try:
        import torch.distributed as distributed
    except ImportError:
        return None
    if not distributed.is_available() or not distributed.is_initialized():
        return None
    return distributed


def torch_dump() -> Callable[[], bytes] | None:
    """torch's flight-recorder dump of the process-group status, where torch has one."""
    if _initialized_distributed() is None:
        return None
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None

    def status() -> bytes:
        return bytes(dump(False, False, True))  # no entries, no stacks, active only

    return status


def torch_sequence() -> Callable[[], int] | None:
    """The default group's sequence number, where torch has a default group."""
    distributed = _initialized_distributed()
    if distributed is None or not hasattr(
        distributed.group.WORLD, "_get_sequence_number_for_group"
    ):
        return None

    def sequence() -> int:
        # Looked up at each read: a new init_process_group makes a new default group.
        return int(distributed.group.WORLD._get_sequence_number_for_group())

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
            before = self._default_group_sequence()
            dump = self._dump()
            after = self._default_group_sequence()
            # A collective enqueued between the reads: the number says nothing of this dump.
            return parse_dump(dump, before if before == after else None)
        except Exception as error:  # noqa: BLE001 (a private torch API: contain whatever it does)
            self.error = f"{type(error).__name__}: {error}"[:200]
            return None

    def _default_group_sequence(self) -> int | None:
        if self._sequence is None:
            return None
        try:
            return self._sequence()
        except Exception:  # noqa: BLE001 (a backend without sequence numbers raises)
            return None
