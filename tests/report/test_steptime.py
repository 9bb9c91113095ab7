"""stabmon.report.steptime: which medians moved, on event logs written by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
from compare_helpers import attach_record, throughput_records, write_run

from stabmon.report.digest import RunDigest, read_digest
from stabmon.report.steptime import PhaseRow, Spread, StepTime, compare_step_time

STEADY = {"data_wait": 0.001, "forward": 0.004, "backward": 0.004, "optimizer": 0.001}


def _run(path: Path, blocks: list[dict[str, float]], **attach: str) -> RunDigest:
    return read_digest(write_run(path, {0: [attach_record(**attach), *throughput_records(blocks)]}))


def _compare(a: RunDigest, b: RunDigest) -> StepTime:
    return compare_step_time(a, b, a.ranks, b.ranks)


def _row(result: StepTime, phase: str) -> PhaseRow:
    (row,) = [row for row in result.whole() if row.phase == phase]
    return row


def _jitter(per_step: dict[str, float], count: int, spread: float = 0.01) -> list[dict[str, float]]:
    return [{p: s * (1 + spread * (i % 3 - 1)) for p, s in per_step.items()} for i in range(count)]


def test_spread_is_the_median_and_quartiles_of_the_blocks() -> None:
    assert Spread.of([4.0, 1.0, 3.0, 2.0, 5.0]) == Spread(3.0, 2.0, 4.0, 5)
    assert Spread.of([]) is None


def test_a_phase_10_percent_slower_moved_and_is_named(tmp_path: Path) -> None:
    slower = {**STEADY, "forward": 0.0055}
    a, b = _run(tmp_path / "a", _jitter(STEADY, 8)), _run(tmp_path / "b", _jitter(slower, 8))

    result = _compare(a, b)

    assert result.comparable and _row(result, "forward").moved == "slower"
    assert _row(result, "step").moved == "slower"  # 10 ms to 11.5 ms
    assert _row(result, "backward").moved is None
    most = result.moved_most()
    assert most is not None and most.phase == "forward"
    assert most.change == pytest.approx(0.375, rel=0.05)


def test_a_median_that_moved_less_than_10_percent_did_not_move(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", _jitter(STEADY, 8))
    b = _run(tmp_path / "b", _jitter({**STEADY, "forward": 0.0043}, 8))

    assert [row.moved for row in _compare(a, b).rows] == [None] * 5


def test_a_tiny_phase_that_doubled_moves_nothing(tmp_path: Path) -> None:
    tiny = {**STEADY, "optimizer": 0.0001}
    a = _run(tmp_path / "a", _jitter(tiny, 8))
    b = _run(tmp_path / "b", _jitter({**tiny, "optimizer": 0.0002}, 8))

    assert _row(_compare(a, b), "optimizer").moved is None  # 0.1 ms of a 9 ms step


def test_medians_whose_middle_halves_overlap_did_not_move(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", _jitter(STEADY, 9, spread=0.3))
    b = _run(tmp_path / "b", _jitter({k: v * 1.12 for k, v in STEADY.items()}, 9, spread=0.3))

    assert _row(_compare(a, b), "step").moved is None


def test_different_world_sizes_are_inconclusive_with_the_reason(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", _jitter(STEADY, 4), WORLD_SIZE="2")
    b = _run(tmp_path / "b", _jitter({**STEADY, "forward": 0.04}, 4), WORLD_SIZE="4")

    result = _compare(a, b)

    assert result.reasons == ("world size differs (A 2, B 4 ranks)",)
    assert all(row.moved is None for row in result.rows)


def test_a_run_without_throughput_records_is_inconclusive(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", _jitter(STEADY, 4))
    b = read_digest(write_run(tmp_path / "b", {0: [attach_record()]}))

    assert any("run B has no throughput record with steps" in r for r in _compare(a, b).reasons)


def test_named_phases_get_rows_of_their_own(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", _jitter({**STEADY, "eval": 0.002}, 4))
    b = _run(tmp_path / "b", _jitter(STEADY, 4))

    row = _row(_compare(a, b), "eval")

    assert row.b is not None and row.b.median == 0.0 and row.moved == "faster"


def test_too_few_blocks_in_the_steps_compared_is_inconclusive_and_says_what_to_do(
    tmp_path: Path,
) -> None:
    a, b = _run(tmp_path / "a", _jitter(STEADY, 3)), _run(tmp_path / "b", _jitter(STEADY, 3))

    result = _compare(a, b)

    assert result.reasons == (
        "too few blocks to compare step time (A rank 0: 3, B rank 0: 3 in steps 0-29; 4 "
        "needed); set throughput.record_seconds lower or run longer",
    )
    assert all(row.moved is None for row in result.rows)


def test_blocks_that_reach_into_the_warm_up_are_left_out(tmp_path: Path) -> None:
    records = [attach_record(), *throughput_records(_jitter(STEADY, 8))]
    records[0]["config"]["throughput"]["slowdown_warmup_steps"] = 20
    a = read_digest(write_run(tmp_path / "a", {0: records}))

    result = _compare(a, a)

    step = _row(result, "step").a
    assert result.first_step == 20 and step is not None and step.blocks == 6  # steps 20-79


def test_time_shifted_between_phases_moves_the_phases_but_not_the_step(tmp_path: Path) -> None:
    shifted = {**STEADY, "forward": 0.002, "backward": 0.006}
    a, b = _run(tmp_path / "a", _jitter(STEADY, 8)), _run(tmp_path / "b", _jitter(shifted, 8))

    result = _compare(a, b)

    assert _row(result, "step").moved is None
    assert _row(result, "backward").moved == "slower" and _row(result, "forward").moved == "faster"


def test_samples_per_step_are_read_over_the_steps_compared(tmp_path: Path) -> None:
    # A runs 100 steps, B 200: a whole run's samples per step would differ (B's later
    # steps hold more samples), the steps both reached do not.
    a_records = throughput_records(_jitter(STEADY, 10))
    b_records = throughput_records(_jitter(STEADY, 20))
    for index, record in enumerate(b_records[10:], start=11):
        record["samples"] = 400 + (index - 10) * 80  # 8 per step after step 99
    a = read_digest(write_run(tmp_path / "a", {0: [attach_record(), *a_records]}))
    b = read_digest(write_run(tmp_path / "b", {0: [attach_record(), *b_records]}))

    assert _compare(a, b).reasons == ()
