"""The event log: strict JSON lines, and failures that are counted, not raised."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stabmon.export.event_log import EventLog, to_json_safe
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter


def _guard() -> Guard:
    return Guard(LogLimiter(per_minute=10), ["event_log"])


def test_event_log_writes_one_strict_json_object_per_line(tmp_path: Path) -> None:
    log = EventLog(
        tmp_path / "run" / "events.jsonl", common={"run": "r", "rank": 0}, guard=_guard()
    )
    log.write("anomaly", kind="nonfinite_grad", step=5, grad_norm=float("nan"))
    log.write("epoch", epoch=0, memory={"host": 1.0}, drift={"host": float("inf")})
    log.close()
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=pytest.fail) for line in lines]
    assert records[0]["event"] == "anomaly" and records[0]["grad_norm"] == "nan"
    assert records[0]["run"] == "r" and records[0]["rank"] == 0 and records[0]["step"] == 5
    assert records[1]["drift"] == {"host": "inf"}


def test_event_log_appends_across_processes_restarts(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    for run in range(2):
        log = EventLog(path, common={"attempt": run}, guard=_guard())
        log.write("attach")
        log.close()
    assert [json.loads(line)["attempt"] for line in path.read_text().splitlines()] == [0, 1]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_event_log_in_a_read_only_directory_is_counted_not_raised(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    guard = _guard()
    log = EventLog(tmp_path / "sub" / "events.jsonl", common={}, guard=guard)
    log.write("attach")
    assert not log.enabled
    assert guard.counts["event_log"] == 1
    tmp_path.chmod(0o700)


def test_event_log_refuses_a_device_in_place_of_its_file_counted_not_raised() -> None:
    # A full disk proper: tests/security/test_run_directory.py (a file-size limit, part-writes).
    guard = _guard()
    log = EventLog(Path("/dev/full"), common={}, guard=guard)
    log.write("attach")
    log.close()
    assert not log.enabled
    assert guard.counts["event_log"] == 1


def test_to_json_safe_turns_unknown_objects_into_strings() -> None:
    assert to_json_safe({"p": Path("/x"), "t": (1, float("-inf"))}) == {"p": "/x", "t": [1, "-inf"]}
