"""stabmon.detectors.leak_rules: the epoch-window and trend leak rules, reconciled.

Host values go in as the readback delivers them (tests/judges.py); the records are read
back from the real event log."""

from __future__ import annotations

from pathlib import Path

from tests.judges import Judges


def test_leak_rules_reports_a_leak_once_when_epoch_memory_keeps_growing(tmp_path: Path) -> None:
    harness = Judges(
        tmp_path,
        leak_rule="epoch_windows",
        leak_window_epochs=1,
        leak_windows=2,
        leak_warmup_epochs=0,
        leak_threshold=0.03,
    )
    memory = 100e6
    for _ in range(8):
        harness.readings.steps += 10
        harness.epoch({"cuda:0": memory}, {"cuda:0": memory})
        memory *= 1.10
    (leak,) = harness.anomalies("memory_leak")
    assert leak["device"] == "cuda:0"
    assert harness.readings.memory_leak_suspected == {"cuda:0": 1}
    epochs = harness.records("epoch")
    assert [r["epoch"] for r in epochs] == list(range(8))
    assert [r["step"] for r in epochs] == [9, 19, 29, 39, 49, 59, 69, 79]
    assert harness.readings.epoch == 8


def test_leak_rules_reports_no_leak_while_epoch_memory_stays_flat(tmp_path: Path) -> None:
    harness = Judges(
        tmp_path,
        leak_rule="epoch_windows",
        leak_window_epochs=1,
        leak_windows=2,
        leak_warmup_epochs=0,
    )
    for _ in range(8):
        harness.epoch({"cuda:0": 100e6}, {"cuda:0": 100e6})
    assert harness.anomalies("memory_leak") == []
    assert harness.readings.memory_leak_suspected == {"cuda:0": 0}
