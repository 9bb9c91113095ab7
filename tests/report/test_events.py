"""stabmon.report.events: reading a run's event logs as they are on disk, whole, cut short,
hostile or still being written. Real files in tmp_path; the registration records are
real rundir records."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from stabmon.errors import StabmonError
from stabmon.report.events import MAX_DEPTH, find_run, number, read_log, read_run
from stabmon.shared.rundir import ProcessRecord, boot_id, run_directory_name


def _line(event: str, **fields: Any) -> str:
    return json.dumps({"event": event, "time": 1_700_000_000.0, **fields}) + "\n"


def _write_log(directory: Path, rank: int, *lines: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{rank}.events.jsonl"
    path.write_text("".join(lines))
    return path


def _register(directory: Path, rank: int, **fields: Any) -> None:
    record = ProcessRecord(
        pid=fields.pop("pid", os.getpid()),
        create_time=0.0,
        run=directory.name,
        rank=rank,
        boot_id=boot_id(),
        **fields,
    )
    (directory / f"rank-{rank}.json").write_bytes(record.to_json())


def test_read_log_keeps_whole_records_in_order_and_takes_the_rank_from_the_name(
    tmp_path: Path,
) -> None:
    path = _write_log(tmp_path, 3, _line("attach", run="r"), _line("epoch", step=9, epoch=0))
    log = read_log(path)
    assert log.rank == 3
    assert [r["event"] for r in log.records] == ["attach", "epoch"]
    assert log.notes == []


def test_read_log_skips_a_last_line_cut_short_with_a_note(tmp_path: Path) -> None:
    path = _write_log(tmp_path, 0, _line("attach"), '{"event": "epoch", "st')
    log = read_log(path)
    assert [r["event"] for r in log.records] == ["attach"]
    (note,) = log.notes
    assert "last line" in note and "incomplete" in note


def test_read_log_keeps_a_whole_last_record_without_newline_and_says_so(tmp_path: Path) -> None:
    path = _write_log(tmp_path, 0, _line("attach"), _line("detach", step=4).rstrip("\n"))
    log = read_log(path)
    assert [r["event"] for r in log.records] == ["attach", "detach"]
    assert "has no newline" in log.notes[0]


@pytest.mark.parametrize(
    "bad",
    [
        "not json\n",
        "[1, 2]\n",
        json.dumps({"event": 7}) + "\n",
        json.dumps({"event": "epoch", "step": True}) + "\n",
        json.dumps({"event": "epoch", "step": 2**64}) + "\n",
        json.dumps({"event": "epoch", "time": -1}) + "\n",
        json.dumps(
            {"event": "deep", "x": json.loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))}
        )
        + "\n",
    ],
    ids=[
        "not-json",
        "not-an-object",
        "event-not-text",
        "bool-step",
        "huge-step",
        "negative-time",
        "too-deep",
    ],
)
def test_read_log_counts_a_malformed_middle_line_and_keeps_the_rest(
    tmp_path: Path, bad: str
) -> None:
    path = _write_log(tmp_path, 0, _line("attach"), bad, _line("detach", step=1))
    log = read_log(path)
    assert [r["event"] for r in log.records] == ["attach", "detach"]
    assert log.notes == ["rank-0.events.jsonl: 1 malformed line(s) skipped (line 2)"]


def test_read_log_notes_a_fifo_under_a_logs_name_instead_of_blocking(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.events.jsonl"
    os.mkfifo(path)
    log = read_log(path)
    assert log.records == []
    assert "not read" in log.notes[0]


def test_last_step_ignores_anomalies_and_a_stall_end_whose_step_never_completed(
    tmp_path: Path,
) -> None:
    path = _write_log(
        tmp_path,
        0,
        _line("epoch", step=9),
        _line("anomaly", kind="stall", step=10),
        _line("stall_end", step=10, completed=False),
    )
    log = read_log(path)
    assert (log.last_step, log.steps) == (9, 10)


def test_last_step_is_none_before_the_first_step(tmp_path: Path) -> None:
    log = read_log(_write_log(tmp_path, 0, _line("attach"), _line("detach", step=None)))
    assert (log.last_step, log.steps) == (None, 0)


def test_a_rank_that_detached_after_its_last_attach_is_finished(tmp_path: Path) -> None:
    run = tmp_path / "r"
    _write_log(run, 0, _line("attach"), _line("detach", step=3))
    (log,) = read_run(run).ranks
    assert log.state == "finished"


def test_a_rank_reattached_after_a_detach_is_not_finished(tmp_path: Path) -> None:
    run = tmp_path / "r"
    _write_log(run, 0, _line("attach"), _line("detach", step=3), _line("attach"))
    (log,) = read_run(run).ranks
    assert log.state == "vanished"  # no registration record, no detach since


def test_a_registered_live_process_is_running_and_its_heartbeat_counts_steps(
    tmp_path: Path,
) -> None:
    run = tmp_path / run_directory_name("r")
    _write_log(run, 0, _line("attach", run="r"))
    _register(run, 0, steps=25)
    (log,) = read_run(run).ranks
    assert log.state == "running"
    assert log.last_step == 24


def test_a_registration_with_an_exception_exit_is_crashed(tmp_path: Path) -> None:
    run = tmp_path / run_directory_name("r")
    _write_log(run, 0, _line("attach"))
    _register(run, 0, exit_status="exception", exited_unix=1.0)
    assert read_run(run).ranks[0].state == "crashed"


def test_a_registration_from_another_boot_is_not_alive(tmp_path: Path) -> None:
    run = tmp_path / run_directory_name("r")
    _write_log(run, 0, _line("attach"))
    record = ProcessRecord(pid=os.getpid(), create_time=0.0, run="r", rank=0, boot_id="other-boot")
    (run / "rank-0.json").write_bytes(record.to_json())
    assert read_run(run).ranks[0].state == "vanished"


def test_read_run_orders_ranks_numerically_and_sorts_anomalies_by_time(tmp_path: Path) -> None:
    run = tmp_path / "r"
    _write_log(
        run,
        10,
        _line("attach"),
        json.dumps({"event": "anomaly", "kind": "stall", "time": 20.0}) + "\n",
    )
    _write_log(
        run,
        2,
        _line("attach"),
        json.dumps({"event": "anomaly", "kind": "loss_spike", "time": 10.0}) + "\n",
    )
    loaded = read_run(run)
    assert [log.rank for log in loaded.ranks] == [2, 10]
    assert [a["kind"] for a in loaded.anomalies()] == ["loss_spike", "stall"]


def test_run_id_comes_from_the_attach_record_else_the_directory(tmp_path: Path) -> None:
    named = tmp_path / "a"
    _write_log(named, 0, _line("attach", run="job-7"))
    unnamed = tmp_path / "b"
    _write_log(unnamed, 0, _line("epoch", step=0))
    assert (read_run(named).run_id, read_run(unnamed).run_id) == ("job-7", "b")


def test_find_run_in_the_root_takes_the_latest_run_and_says_so(tmp_path: Path) -> None:
    old = _write_log(tmp_path / "old", 0, _line("attach"))
    new = _write_log(tmp_path / "new", 0, _line("attach"))
    os.utime(old, (1_000, 1_000))
    os.utime(new, (2_000, 2_000))
    directory, logs, notes = find_run(tmp_path)
    assert (directory, logs) == (tmp_path / "new", [new])
    assert notes == [f"{tmp_path} holds 2 runs; this report is of the latest, new"]


def test_find_run_of_one_log_reads_that_log(tmp_path: Path) -> None:
    path = _write_log(tmp_path, 1, _line("attach"))
    assert find_run(path) == (tmp_path, [path], [])


def test_find_run_names_what_to_pass_when_there_is_no_log(tmp_path: Path) -> None:
    with pytest.raises(StabmonError, match="no event log .* pass <run_dir>/<run_id>"):
        find_run(tmp_path)
    with pytest.raises(StabmonError, match="neither a run directory nor an event log"):
        find_run(tmp_path / "missing")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (3, 3.0),
        (2.5, 2.5),
        ("inf", float("inf")),
        (True, None),
        ("3", None),
        (None, None),
        (10**400, None),
    ],
)
def test_number_reads_record_numbers_and_nothing_else(raw: object, expected: float | None) -> None:
    assert number(raw) == expected


def test_number_reads_nan_as_nan() -> None:
    value = number("nan")
    assert value is not None and value != value
