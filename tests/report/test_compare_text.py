"""stabmon.report.compare_text: what a person reads on the terminal, from logs written by hand."""

from __future__ import annotations

from pathlib import Path

from compare_helpers import attach_record, throughput_records, write_run

from stabmon.report.compare import Comparison, compare_runs
from stabmon.report.compare_text import format_comparison, tables
from stabmon.report.digest import read_digest

STEADY = {"data_wait": 0.001, "forward": 0.004, "backward": 0.004, "optimizer": 0.001}


def _comparison(tmp_path: Path, forward_b: float, **variables: str) -> Comparison:
    blocks_a = [STEADY] * 4
    blocks_b = [{**STEADY, "forward": forward_b}] * 4
    a = write_run(tmp_path / "a", {0: [attach_record(), *throughput_records(blocks_a)]})
    b = write_run(tmp_path / "b", {0: [attach_record(**variables), *throughput_records(blocks_b)]})
    return compare_runs(read_digest(a), read_digest(b))


def test_the_answer_opens_with_both_runs_and_the_verdict(tmp_path: Path) -> None:
    text = format_comparison(_comparison(tmp_path, 0.008)).splitlines()

    assert text[0] == "stabmon compare (B against A, every rank)"
    assert text[1].startswith(f"  A: a ({tmp_path / 'a'}): 1 rank, 40 steps, ")
    assert text[4] == "Verdict: REGRESSED"
    assert text[5] == (
        "  - step +40%: 10 ms -> 14 ms per step (steps 0-39); the phase that moved most: "
        "forward (+4 ms per step)"
    )


def test_the_step_time_table_shows_median_spread_blocks_and_change(tmp_path: Path) -> None:
    (table,) = [t for t in tables(_comparison(tmp_path, 0.008)) if t.id == "step-time"]

    forward = next(row for row in table.rows if row[1] == "forward")

    assert forward == ("all", "forward", "4 [4-4] n=4", "8 [8-8] n=4", "+100% (+4 ms)", "slower")


def test_sections_without_rows_say_so(tmp_path: Path) -> None:
    text = format_comparison(_comparison(tmp_path, 0.004))

    assert "Verdict: UNCHANGED" in text
    assert "Environment (only what differs)\n  no difference" in text
    assert "Anomalies by kind\n  none in either run" in text
    assert "AMP (GradScaler)\n  no GradScaler in either run" in text


def test_a_variable_set_only_in_b_reads_absent_in_a(tmp_path: Path) -> None:
    text = format_comparison(_comparison(tmp_path, 0.004, CUDA_LAUNCH_BLOCKING="1"))

    assert "  CUDA_LAUNCH_BLOCKING  (absent)  1" in text
