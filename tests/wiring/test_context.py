"""stabmon.wiring.context.PluginContext: what a plug-in may call reaches the Monitor's recorder,
numbering and judging lock, and nothing more (its members are those of
stabmon.extension.Context)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from stabmon.extension import Context
from tests.judges import Judges


def _context(judges: Judges) -> Context:
    return judges.context  # the one the Judges rig plugged the built-ins with


def test_plugin_context_members_are_exactly_those_the_extension_point_declares(
    tmp_path: Path,
) -> None:
    context = _context(Judges(tmp_path))
    declared = {name for name in Context.__dict__ if not name.startswith("_")}
    declared |= set(Context.__annotations__)
    public = {name for name in dir(context) if not name.startswith("_")}
    assert public == declared


def test_plugin_context_anomaly_counts_writes_and_logs_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    judges = Judges(tmp_path)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        _context(judges).anomaly("grad_spike", 7, "a spike in module encoder", modules=["encoder"])
    (record,) = judges.anomalies("grad_spike")
    assert (record["step"], record["modules"]) == (7, ["encoder"])
    assert judges.readings.anomalies["grad_spike"] == 1
    assert "a spike in module encoder" in caplog.text


def test_plugin_context_event_writes_one_record_and_numbers_steps_across_resumes(
    tmp_path: Path,
) -> None:
    judges = Judges(tmp_path)
    context = _context(judges)
    assert (context.global_step, context.last_step) == (0, None)
    judges.readings.steps = 4
    judges.load_state_dict({**judges.state_dict(), "step": 10})
    context.event("checkpoint_saved", step=context.last_step, path="/ckpt")
    assert (context.global_step, context.last_step) == (10, 9)
    (record,) = judges.records("checkpoint_saved")
    assert (record["step"], record["path"]) == (9, "/ckpt")


def test_plugin_context_judging_is_the_lock_the_judges_run_under(tmp_path: Path) -> None:
    judges = Judges(tmp_path)
    lock: Any = _context(judges).judging()
    with lock:
        assert lock._is_owned()  # re-entrant: a plug-in's thread holds it like the hooks do
