"""stabmon.detectors.spike's rules (GradSpikes, LossSpikes): when a rise is an incident.

Host values go in as the readback delivers them (tests/judges.py); the records are read
back from the real event log."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.judges import Judges


@pytest.fixture
def harness(tmp_path: Path) -> Judges:
    return Judges(tmp_path)


def test_spike_rules_calls_a_loss_ten_times_its_mean_a_spike_at_once(harness: Judges) -> None:
    for step in range(20):
        harness.loss(step, 1.0 + 0.01 * (step % 3))
    harness.loss(20, 50.0)
    (spike,) = harness.anomalies("loss_spike")
    assert (spike["step"], spike["loss"], spike["first_step"]) == (20, 50.0, 20)
    assert harness.readings.loss == 50.0


def test_spike_rules_waits_for_the_next_loss_before_calling_a_moderate_rise_a_spike(
    harness: Judges,
) -> None:
    for step in range(20):
        harness.loss(step, 1.0 + 0.01 * (step % 3))
    harness.loss(20, 3.0)  # a hard batch, or the start of a rise
    assert harness.anomalies("loss_spike") == []
    harness.loss(21, 3.0)  # still up: an incident, recorded at its first step
    (spike,) = harness.anomalies("loss_spike")
    assert (spike["step"], spike["first_step"]) == (20, 20)


def test_spike_rules_forgets_a_moderate_loss_rise_that_falls_back_at_once(harness: Judges) -> None:
    for step in range(20):
        harness.loss(step, 1.0 + 0.01 * (step % 3))
    harness.loss(20, 3.0)
    harness.loss(21, 1.0)
    assert harness.anomalies("loss_spike") == []
