"""stabmon.report.verdict.judge: the one line that says whether a run was healthy, over
Runs built from real event logs in tmp_path."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from stabmon.report.events import read_run
from stabmon.report.verdict import judge, when

T0 = 1_700_000_000.0


def _run(tmp_path: Path, logs: dict[int, list[dict[str, Any]]]) -> Path:
    run = tmp_path / "job"
    run.mkdir()
    for rank, records in logs.items():
        lines = [json.dumps({"time": T0, "rank": rank, **r}) + "\n" for r in records]
        (run / f"rank-{rank}.events.jsonl").write_text("".join(lines))
    return run


def _finished(steps: int, *extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"event": "attach", "run": "job"}, *extra, {"event": "detach", "step": steps - 1}]


def test_judge_calls_a_finished_run_without_anomalies_healthy(tmp_path: Path) -> None:
    run = read_run(_run(tmp_path, {0: _finished(1200), 1: _finished(1200)}))
    verdict = judge(run)
    assert verdict.healthy
    assert verdict.headline == "Healthy: 1,200 steps on 2 ranks, no anomalies; finished."
    assert verdict.findings == ()


def test_judge_names_the_first_anomaly_and_counts_each_kind(tmp_path: Path) -> None:
    spike = {"event": "anomaly", "kind": "loss_spike", "step": 80}
    nan = {"event": "anomaly", "kind": "nonfinite_grad", "step": 30, "time": T0 - 10}
    later = {"event": "anomaly", "kind": "loss_spike", "step": 90, "time": T0 + 5}
    run = read_run(_run(tmp_path, {0: _finished(100, nan, spike, later)}))
    verdict = judge(run)
    assert not verdict.healthy
    assert verdict.headline.startswith(
        "Not healthy: 3 anomalies (nonfinite_grad x1, loss_spike x2); the first, "
        "nonfinite_grad, at step 30 on rank 0"
    )
    assert verdict.headline.endswith("100 steps on 1 rank; finished.")
    assert verdict.findings[0].startswith("nonfinite_grad x1: first at step 30 on rank 0")
    assert "loss_spike x2: first at step 80" in verdict.findings[1]
    assert ", last at step 90 on rank 0" in verdict.findings[1]


def test_judge_calls_a_run_with_a_vanished_rank_not_healthy_even_without_anomalies(
    tmp_path: Path,
) -> None:
    vanished: list[dict[str, Any]] = [
        {"event": "attach", "run": "job"},
        {"event": "epoch", "step": 49},
    ]
    run = read_run(_run(tmp_path, {0: _finished(60), 1: vanished}))
    verdict = judge(run)
    assert not verdict.healthy
    assert "rank 1 stopped without a word" in verdict.headline
    assert "rank 0 finished, rank 1 stopped without a word" in verdict.headline
    (finding,) = verdict.findings
    assert finding.startswith("rank 1 stopped without a word")
    assert "after step 49" in finding
    assert when(T0) in finding


def test_judge_says_before_its_first_step_for_a_rank_that_never_stepped(tmp_path: Path) -> None:
    run = read_run(_run(tmp_path, {0: [{"event": "attach", "run": "job"}]}))
    (finding,) = judge(run).findings
    assert "before its first step" in finding


def test_judge_of_a_run_without_ranks_says_no_records(tmp_path: Path) -> None:
    run = read_run(_run(tmp_path, {0: _finished(1)}))
    run.ranks.clear()
    verdict = judge(run)
    assert verdict.healthy
    assert verdict.headline == "Healthy: 0 steps on 0 ranks, no anomalies; no records."


def test_judge_lists_the_hang_verdicts_the_ranks_wrote(tmp_path: Path) -> None:
    hang = {"event": "hang_verdict", "step": 7, "detail": "rank 1 of 2 stuck in data_wait"}
    run = read_run(_run(tmp_path, {0: _finished(10, hang)}))
    assert "hang verdict at step 7: rank 1 of 2 stuck in data_wait" in judge(run).findings


def test_when_formats_local_time_to_the_second_and_says_when_unknown() -> None:
    assert when(T0) == time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T0))
    assert when(None) == "at an unknown time"
