"""Hang triage as pure functions: a stalled thread's state, and the odd rank out of a run."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from stabmon.contract import HANG_REASONS, HANG_STATES
from stabmon.detectors import hang
from stabmon.detectors.hang import RankEvidence, classify, judge


def _frame(file: str, line: int, function: str, code: str) -> str:
    return f'  File "{file}", line {line}, in {function}\n    {code}'


TRAIN = _frame("/job/train.py", 10, "<module>", "main()")
LOADER = _frame("/venv/lib/python3.12/site-packages/torch/utils/data/dataloader.py", 733,
                "__next__", "data = self._next_data()")  # fmt: skip
USER_DATASET = _frame("/job/data.py", 42, "__getitem__", "time.sleep(3600)")
ALL_REDUCE = _frame("/venv/lib/python3.12/site-packages/torch/distributed/c10d_logger.py", 81,
                    "wrapper", "return func(*args, **kwargs)")  # fmt: skip
LOCK = _frame("/job/train.py", 55, "step", "state_lock.acquire()")
THREAD_WAIT = _frame("/usr/lib/python3.12/threading.py", 355, "wait", "waiter.acquire()")
SAVE = _frame("/venv/lib/python3.12/site-packages/torch/serialization.py", 900, "save",
              "_save(obj, opened_zipfile)")  # fmt: skip
SLEEP = _frame("/job/train.py", 77, "step", "time.sleep(3600)")
STABMON = _frame("/venv/lib/python3.12/site-packages/stabmon/probes/collectives.py", 90,
                 "counted", "return original(*args, **kwargs)")  # fmt: skip


@pytest.mark.parametrize(
    ("stack", "phase", "collective", "state"),
    [
        ([TRAIN, ALL_REDUCE], "backward", None, "collective"),
        ([TRAIN, STABMON, SLEEP], "backward", "all_reduce", "collective"),
        ([TRAIN, LOADER, USER_DATASET], "data_wait", None, "data_wait"),
        ([TRAIN, LOADER, USER_DATASET], "forward", None, "data_wait"),
        ([TRAIN, LOCK], "forward", None, "lock_wait"),
        ([TRAIN, THREAD_WAIT], "optimizer", None, "lock_wait"),
        ([TRAIN, SAVE], "backward", None, "io"),
        ([TRAIN, SLEEP], "backward", None, "compute"),
        ([], "forward", None, "compute"),
    ],
)
def test_classify_names_what_a_stalled_main_thread_does(
    stack: list[str], phase: str, collective: str | None, state: str
) -> None:
    assert classify(stack, phase=phase, collective=collective)[0] == state
    assert state in HANG_STATES


def test_classify_says_where_outside_stabmon_frames() -> None:
    state, where = classify([TRAIN, STABMON, SLEEP], phase="backward", collective="all_reduce")
    assert (state, where) == ("collective", "all_reduce at train.py:77 in step")


def test_classify_reads_a_real_thread_blocked_on_a_lock() -> None:
    lock = threading.Lock()
    entered = threading.Event()

    def deadlocked() -> None:
        entered.set()
        with lock:  # held by the test: this thread waits here until released
            pass

    lock.acquire()
    blocked = threading.Thread(target=deadlocked, daemon=True)
    blocked.start()
    try:
        assert entered.wait(timeout=30)
        time.sleep(0.05)  # past entered.set(), into the with statement
        frame = sys._current_frames()[blocked.ident or -1]
        stack = traceback.format_stack(frame)
        del frame
        state, where = classify(stack, phase="forward", collective=None)
        assert state == "lock_wait"
        assert where.startswith("test_hang.py:")
    finally:
        lock.release()
        blocked.join(timeout=5)


def _rank(rank: int, state: str | None, *, stalled: bool = True, collectives: int = 7,
          where: str = "train.py:60 in step") -> RankEvidence:  # fmt: skip
    return RankEvidence(rank=rank, stalled=stalled, phase="backward", state=state,
                        collectives=collectives, where=where)  # fmt: skip


def test_judge_names_the_rank_starved_of_data_while_the_others_wait_in_a_collective() -> None:
    starved = _rank(2, "data_wait", where="data.py:42 in __getitem__")
    ranks = [_rank(0, "collective"), _rank(1, "collective"), starved, _rank(3, "collective")]
    verdict = judge(ranks)
    assert verdict is not None
    assert (verdict.culprits, verdict.reason, verdict.world) == ((2,), "data_starvation", 4)
    assert verdict.message.startswith("rank 2 of 4 stuck in data_wait at data.py:42")
    assert "the other 3 wait in collective" in verdict.message


@pytest.mark.parametrize(
    ("odd", "reason"),
    [("lock_wait", "deadlock"), ("io", "io"), ("compute", "collective_not_entered")],
)
def test_judge_gives_the_reason_class_of_the_odd_state(odd: str, reason: str) -> None:
    verdict = judge([_rank(0, "collective"), _rank(1, odd), _rank(2, "collective")])
    assert verdict is not None
    assert (verdict.culprits, verdict.reason) == ((1,), reason)
    assert reason in HANG_REASONS


def test_judge_names_a_computing_rank_when_the_others_wait_on_data() -> None:
    verdict = judge([_rank(0, "data_wait"), _rank(1, "compute"), _rank(2, "data_wait")])
    assert verdict is not None and verdict.reason == "compute"


def test_judge_names_the_rank_behind_in_collectives_when_all_wait_in_one() -> None:
    ranks = [_rank(rank, "collective", collectives=7 if rank == 1 else 8) for rank in range(4)]
    verdict = judge(ranks)
    assert verdict is not None
    assert (verdict.culprits, verdict.reason) == ((1,), "collective_not_entered")


def test_judge_stays_quiet_while_one_rank_is_not_stalled() -> None:
    # Rank 0 writes a checkpoint inside mon.phase("checkpoint") (its limit is the phase's);
    # the others wait for it in a barrier and stall.
    ranks = [_rank(0, None, stalled=False), _rank(1, "collective"), _rank(2, "collective"),
             _rank(3, "collective")]  # fmt: skip
    assert judge(ranks) is None


@pytest.mark.parametrize(
    "states",
    [
        ["collective", "collective", "collective", "collective"],  # all alike: no odd one
        ["collective", "collective"],  # two ranks in one collective, as many issued
        ["data_wait", "data_wait"],  # two ranks, both starved: a tie of equals
        ["data_wait", "lock_wait"],  # neither waits on the other in a collective
        ["collective", "data_wait", "lock_wait"],  # the two not in it disagree
        ["data_wait", "data_wait", "compute", "compute"],  # a tie, no collective
    ],
)
def test_judge_stays_quiet_without_a_minority_to_name(states: list[str]) -> None:
    assert judge([_rank(index, state) for index, state in enumerate(states)]) is None


@pytest.mark.parametrize(
    ("odd", "reason"),
    [
        ("data_wait", "data_starvation"),
        ("compute", "collective_not_entered"),
        ("lock_wait", "deadlock"),
        ("io", "io"),
    ],
)
@pytest.mark.parametrize("culprit", [0, 1])
def test_judge_names_the_rank_of_two_that_is_not_in_the_collective_the_other_waits_in(
    odd: str, reason: str, culprit: int
) -> None:
    ranks = [_rank(rank, odd if rank == culprit else "collective") for rank in (0, 1)]
    verdict = judge(ranks)
    assert verdict is not None
    assert (verdict.culprits, verdict.reason, verdict.world) == ((culprit,), reason, 2)
    assert verdict.message.startswith(f"rank {culprit} of 2 stuck in {odd}")
    assert "the other 1 wait in collective" in verdict.message


def test_judge_names_the_rank_of_two_that_issued_fewer_collectives() -> None:
    verdict = judge([_rank(0, "collective", collectives=9), _rank(1, "collective", collectives=8)])
    assert verdict is not None
    assert (verdict.culprits, verdict.reason) == ((1,), "collective_not_entered")


def test_judge_names_the_two_ranks_not_in_the_collective_the_other_two_wait_in() -> None:
    states = ["collective", "data_wait", "collective", "data_wait"]
    verdict = judge([_rank(index, state) for index, state in enumerate(states)])
    assert verdict is not None and (verdict.culprits, verdict.reason) == ((1, 3), "data_starvation")


def test_judge_stays_quiet_when_most_ranks_are_behind_one() -> None:
    # Three issued 7, one issued 8: one extra call or three skipped ones; not unambiguous.
    ranks = [_rank(rank, "collective", collectives=8 if rank == 0 else 7) for rank in range(4)]
    assert judge(ranks) is None


def test_judge_stays_quiet_for_a_single_rank() -> None:
    assert judge([_rank(0, "data_wait")]) is None


def _flown(rank: int, state: str, flight: tuple[int, int, int] | None,
           collectives: int = 7) -> RankEvidence:  # fmt: skip
    return RankEvidence(rank=rank, stalled=True, phase="backward", state=state,
                        collectives=collectives, flight=flight)  # fmt: skip


def test_judge_names_the_rank_the_flight_recorder_shows_behind_while_all_compute() -> None:
    # NCCL: every rank returned from its all_reduce call and blocks later in a device sync
    # (a Python "compute"); rank 2 never enqueued collective 812 (recorded-shaped numbers).
    ranks = [_flown(rank, "compute", (811 if rank == 2 else 812, -1, 811)) for rank in range(4)]
    verdict = judge(ranks)
    assert verdict is not None
    assert (verdict.culprits, verdict.reason) == ((2,), "collective_not_entered")


def test_judge_prefers_the_flight_recorder_to_the_python_counter() -> None:
    # DDP's C++ all-reduces are not in the Python counter (equal), but the recorder has them.
    ranks = [_flown(rank, "collective", (40 if rank == 1 else 41, -1, 40)) for rank in range(4)]
    verdict = judge(ranks)
    assert verdict is not None and verdict.culprits == (1,)


def test_judge_does_not_read_a_lagging_completion_as_behind() -> None:
    # gloo marks completions late: equal enqueued and started, different completed.
    ranks = [_flown(rank, "collective", (41, -1, 39 if rank == 3 else 40)) for rank in range(4)]
    assert judge(ranks) is None


def test_judge_falls_back_to_the_counter_when_a_rank_has_no_flight_recorder() -> None:
    ranks = [_flown(0, "collective", (41, -1, 40), collectives=9),
             _flown(1, "collective", None, collectives=8)]  # fmt: skip
    verdict = judge(ranks)
    assert verdict is not None and verdict.culprits == (1,)


def test_judge_stays_quiet_for_ranks_all_computing_without_the_flight_recorder() -> None:
    assert judge([_flown(rank, "compute", None) for rank in range(4)]) is None


def test_classify_skips_stabmons_own_frames_but_not_a_project_named_stabmon() -> None:
    """A checkout or project in a directory named ``stabmon`` is the user's code, not ours:
    only the installed package's own frames are skipped (a fresh clone at
    ``/tmp/x/stabmon`` once made every deadlock read as ``compute``)."""
    ours = str(Path(hang.__file__).resolve())
    stack = [
        '  File "/home/user/stabmon/train.py", line 42, in step\n    with self.lock:\n',
        f'  File "{ours}", line 7, in stalled\n    self.record()\n',
    ]
    assert classify(stack, phase="forward", collective=None) == (
        "lock_wait",
        "train.py:42 in step",
    )
