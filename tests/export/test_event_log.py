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


def test_a_log_whose_run_directory_is_deleted_is_reopened_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    guard = _guard()
    path = tmp_path / "run" / "rank-0.events.jsonl"
    log = EventLog(path, common={}, guard=guard)
    log.write("attach")
    shutil.rmtree(tmp_path / "run")  # a cleanup job, while the run trains
    log.write("anomaly", kind="nonfinite_grad", step=7)
    log.write("anomaly", kind="nonfinite_grad", step=8)
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [7, 8]
    assert guard.counts["event_log"] == 1
    assert caplog.text.count("was removed while the run trained") == 1


def test_a_forked_child_writes_nothing_into_its_parents_log(tmp_path: Path) -> None:
    import warnings

    path = tmp_path / "rank-0.events.jsonl"
    log = EventLog(path, common={}, guard=_guard())
    log.write("attach")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded pytest
        child = os.fork()
    if child == 0:  # a DataLoader worker, say
        log.write("anomaly", kind="from_the_child")
        os._exit(0)
    os.waitpid(child, 0)
    log.write("detach")
    log.close()
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == [
        "attach",
        "detach",
    ]
