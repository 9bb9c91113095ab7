"""stabmon.pipeline.recorder.Recorder through its own interface: counting, records, step numbers and
the state a checkpoint carries (with the built-in judges' state, as the Monitor combines
them: tests/judges.py). No Monitor: numbers go in as the read-back would deliver them, and
the real event log is read back from tmp_path."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from stabmon.config import load_config
from stabmon.errors import StabmonError
from stabmon.pipeline.readings import Readings
from stabmon.pipeline.recorder import Recorder
from stabmon.shared.log import LogLimiter
from tests.judges import Judges


@pytest.fixture
def harness(tmp_path: Path) -> Judges:
    return Judges(tmp_path)


def test_recorder_writes_a_worker_death_with_its_signal_and_warns_once(
    harness: Judges, caplog: pytest.LogCaptureFixture
) -> None:
    harness.readings.steps = 12
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        harness.recorder.worker_died({"worker": 1, "pid": 4242, "signal": 9, "exitcode": None})
    (record,) = harness.records("loader_worker_died")
    assert (record["step"], record["pid"], record["signal"]) == (12, 4242, 9)
    assert "died with signal 9 at step 12" in caplog.text


def test_recorder_state_round_trip_continues_step_numbering_in_a_new_process(
    tmp_path: Path,
) -> None:
    first = Judges(tmp_path / "a")
    first.readings.steps = 40
    first.readings.epoch = 3
    state = first.state_dict()
    second = Judges(tmp_path / "b")
    second.readings.steps = 3  # steps this process took before the checkpoint was loaded
    second.load_state_dict(state)
    assert (second.recorder.global_step, second.recorder.last_step) == (40, 39)
    assert second.readings.epoch == 3
    (resume,) = second.records("resume")
    assert (resume["step"], resume["epoch"]) == (39, 3)
    second.readings.steps = 5  # two more steps
    assert second.recorder.last_step == 41


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 1}, "version 2"),
        ({"step": -1}, "expected integers >= 0"),
        ({"epoch": True}, "expected integers >= 0"),
        ({"leaks": {"cuda:0": {"bogus": 1}}}, "malformed"),
    ],
)
def test_recorder_rejects_a_bad_state_and_changes_nothing(
    harness: Judges, change: dict[str, Any], message: str
) -> None:
    state = {**harness.state_dict(), **change}
    harness.readings.steps = 5
    with pytest.raises(StabmonError, match=message):
        harness.load_state_dict(state)
    assert (harness.recorder.global_step, harness.readings.epoch) == (5, 0)
    assert harness.records("resume") == []


def test_recorder_names_missing_state_keys(harness: Judges) -> None:
    state = harness.state_dict()
    del state["leaks"], state["epoch"]
    with pytest.raises(StabmonError, match="missing key\\(s\\) epoch, leaks"):
        harness.load_state_dict(state)


def test_recorder_without_an_event_log_still_counts_anomalies(tmp_path: Path) -> None:
    readings = Readings(labels={})
    recorder = Recorder(load_config({}, env={}), readings, events=None, limiter=LogLimiter())
    recorder.anomaly("stall", 3, "no step completed")
    assert readings.anomalies["stall"] == 1
