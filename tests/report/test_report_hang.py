"""stabmon.report.hang: the hang verdict of ``stabmon status`` over RankStatus scrapes, and
the hang lines of ``stabmon report`` over real event logs in tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

from stabmon.report.events import read_run
from stabmon.report.hang import STALL_EXIT_CODE, format_verdicts, hang_findings
from stabmon.report.status import RankStatus
from stabmon.wiring.stall_action import STALL_EXIT_CODE as MONITOR_STALL_EXIT_CODE


def _status(
    rank: str,
    state: str | None,
    *,
    run: str = "job",
    stalled: bool = True,
    collectives: float = 5.0,
    error: str | None = None,
) -> RankStatus:
    return RankStatus(
        url=f"http://n/{rank}",
        run=run,
        rank=rank,
        stalled=stalled,
        phase="forward",
        hang_state=state,
        collectives=collectives,
        error=error,
    )


def test_format_verdicts_names_the_odd_rank_out_of_a_stalled_run() -> None:
    statuses = [_status(str(r), "collective") for r in range(3)] + [_status("3", "data_wait")]
    (line,) = format_verdicts(statuses)
    assert line.startswith("run job: HANG ")
    assert "rank 3" in line
    assert "data" in line


def test_format_verdicts_gives_no_verdict_while_a_rank_is_not_stalled() -> None:
    statuses = [
        _status("0", "collective"),
        _status("1", "collective"),
        _status("2", "data_wait", stalled=False),
    ]
    assert format_verdicts(statuses) == []


def test_format_verdicts_judges_each_run_apart_and_sorts_them() -> None:
    statuses = [
        *(_status(str(r), "collective", run="b") for r in range(2)),
        _status("2", "lock_wait", run="b"),
        *(_status(str(r), "collective", run="a") for r in range(2)),
        _status("2", "io", run="a"),
    ]
    lines = format_verdicts(statuses)
    assert [line.split(":")[0] for line in lines] == ["run a", "run b"]


def test_format_verdicts_leaves_out_unreachable_ranks_and_non_numeric_ranks() -> None:
    statuses = [
        _status("0", "collective"),
        _status("1", "data_wait", error="refused"),
        _status("?", "data_wait"),
    ]
    # Only rank 0 is left: one rank is no run to judge.
    assert format_verdicts(statuses) == []


def test_hang_findings_list_each_distinct_verdict_once_and_the_ranks_that_exited(
    tmp_path: Path,
) -> None:
    run = tmp_path / "job"
    run.mkdir()
    verdict = {"event": "hang_verdict", "step": 9, "detail": "rank 1 of 2 stuck in io"}
    for rank in (0, 1):
        records = [verdict, {"event": "stall_exit", "step": 9}] if rank else [verdict]
        (run / f"rank-{rank}.events.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records)
        )
    assert hang_findings(read_run(run)) == [
        "hang verdict at step 9: rank 1 of 2 stuck in io",
        f"stall_action exit: rank(s) 1 ended the job (status {STALL_EXIT_CODE})",
    ]


def test_the_reports_stall_exit_code_is_the_one_the_monitor_exits_with() -> None:
    assert STALL_EXIT_CODE == MONITOR_STALL_EXIT_CODE
