"""torch's flight recorder: the default group's sequence numbers, parsed and read for real.

NCCL cannot run here (no GPU): the NCCL shapes are recorded-shaped dumps, built from the
format torch documents (``pg_status`` in the flight recorder tutorial: ints in the pickle
dump, strings in the JSON one). The read itself is tested for real on gloo, which torch
2.13's flight recorder follows too, through the same ``_dump_fr_trace`` call.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stabmon.probes.flight_recorder import FlightRecorder, parse_dump, torch_dump

#: As ProcessGroupNCCL dumps it (pickle): rank waiting in collective 2, its first done.
NCCL_DUMP = {
    "version": "2.5",
    "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
    "pg_status": {
        "0": {
            "last_enqueued_collective": 2,
            "last_started_collective": -1,
            "last_completed_collective": 1,
        },
        "1": {
            "last_enqueued_collective": 9,
            "last_started_collective": 9,
            "last_completed_collective": 9,
        },
    },  # fmt: skip
    "entries": [],
}


def test_parse_dump_reads_the_default_groups_sequence_numbers_from_the_pickle() -> None:
    assert parse_dump(pickle.dumps(NCCL_DUMP)) == (2, -1, 1)


def test_parse_dump_reads_the_json_dumps_string_numbers() -> None:
    status = {"0": {"last_enqueued_collective": "7", "last_started_collective": "7",
                    "last_completed_collective": "6"}}  # fmt: skip
    assert parse_dump({"pg_status": status}) == (7, 7, 6)


@pytest.mark.parametrize(
    "dump",
    [
        {"version": "2.5"},  # no pg_status
        {"pg_status": {}},  # no default group
        {"pg_status": {"0": {"last_enqueued_collective": "many"}}},
        {"pg_status": {"0": {"last_enqueued_collective": True}}},
        {"pg_status": {"0": {"last_enqueued_collective": -1}}},  # nothing followed
        {"pg_status": {"0": {"last_enqueued_collective": 2**70}}},
        [1, 2, 3],
    ],
)
def test_parse_dump_gives_none_for_what_is_not_a_usable_status(dump: object) -> None:
    assert parse_dump(dump if isinstance(dump, dict) else pickle.dumps(dump)) is None


def test_flight_recorder_contains_a_failing_dump() -> None:
    def broken() -> bytes:
        raise RuntimeError("flight recorder not enabled")

    recorder = FlightRecorder(broken)
    assert recorder.progress() is None
    assert recorder.error == "RuntimeError: flight recorder not enabled"


def test_flight_recorder_is_none_without_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is up in this test process")
    assert torch_dump() is None and FlightRecorder().progress() is None


@pytest.fixture
def gloo_group(tmp_path: Path) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already up in this test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_flight_recorder_reads_the_real_gloo_groups_enqueued_collectives(gloo_group: None) -> None:
    if torch_dump() is None:
        pytest.skip("Requires: a torch with the flight recorder dump")
    recorder = FlightRecorder()
    tensor = torch.ones(3)
    dist.all_reduce(tensor)  # the group's status appears with its first collective
    before = recorder.progress()
    assert before is not None
    for _ in range(3):
        dist.all_reduce(tensor)
    after = recorder.progress()
    assert after is not None and after[0] == before[0] + 3
    assert recorder.error is None


def test_parse_dump_finds_the_default_group_by_its_own_sequence_number() -> None:
    # After a destroyed group and a new init: id 0 is the dead group, 2 the live default
    # group, 3 a live subgroup with a count of its own.
    status = {
        "0": {"last_enqueued_collective": 3, "last_completed_collective": 3},
        "2": {"last_enqueued_collective": 6, "last_completed_collective": 5},
        "3": {"last_enqueued_collective": 1, "last_completed_collective": 1},
    }
    assert parse_dump({"pg_status": status}, default_group_sequence=6) == (6, -1, 5)
    # No group has it (gloo counts send and recv in the number, not in the dump): id 0.
    assert parse_dump({"pg_status": status}, default_group_sequence=4) == (3, -1, 3)
    assert parse_dump({"pg_status": status}) == (3, -1, 3)  # no number known: id 0


def test_parse_dump_does_not_guess_between_two_groups_with_the_number() -> None:
    status = {
        "0": {"last_enqueued_collective": 4, "last_completed_collective": 4},  # dead
        "1": {"last_enqueued_collective": 4, "last_completed_collective": 3},  # live
    }
    assert parse_dump({"pg_status": status}, default_group_sequence=4) is None


@pytest.mark.parametrize("key", ["\u0663", "-1", "x", ""])
def test_parse_dump_skips_ids_that_are_not_plain_numbers(key: str) -> None:
    status = {key: {"last_enqueued_collective": 6}, "0": {"last_enqueued_collective": 2}}
    assert parse_dump({"pg_status": status}, default_group_sequence=6) == (2, -1, -1)


def test_flight_recorder_ignores_a_sequence_number_that_moved_or_failed() -> None:
    status = {
        "0": {"last_enqueued_collective": 3, "last_completed_collective": 3},
        "1": {"last_enqueued_collective": 6, "last_completed_collective": 6},
    }
    numbers = iter([6, 7])  # a collective enqueued between the two reads

    def unsupported() -> int:
        raise RuntimeError("backend does not support sequence numbers")

    moved = FlightRecorder(lambda: {"pg_status": status}, lambda: next(numbers))
    assert moved.progress() == (3, -1, 3)
    failing = FlightRecorder(lambda: {"pg_status": status}, unsupported)
    assert failing.progress() == (3, -1, 3) and failing.error is None
    steady = FlightRecorder(lambda: {"pg_status": status}, lambda: 6)
    assert steady.progress() == (6, -1, 6)


def test_flight_recorder_reads_the_live_default_group_after_an_in_process_restart(
    tmp_path: Path,
) -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already up in this test process")
    tensor = torch.ones(3)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'first'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        for _ in range(2):
            dist.all_reduce(tensor)
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'second'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        if torch_dump() is None:
            pytest.skip("Requires: a torch with the flight recorder dump")
        for _ in range(5):
            dist.all_reduce(tensor)
        progress = FlightRecorder().progress()
        assert progress is not None and progress[0] == 5  # not the destroyed group's 2
    finally:
        dist.destroy_process_group()
