"""stabmon.detectors.spike_rules (GradSpikes, LossSpikes): when a rise is an incident.

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


def test_spike_rules_name_the_module_group_that_grew_most_against_its_own_level(
    harness: Judges,
) -> None:
    # encoder steady at ~1, head steady at ~1; at step 60 only the encoder jumps.
    for step in range(60):
        harness.grads(step, 1.0 + 0.01 * (step % 3), 1.0 + 0.01 * (step % 2))
    harness.grads(60, 500.0, 1.0)
    (spike,) = harness.anomalies("grad_spike")
    assert spike["step"] == 60
    assert spike["modules"] == ["encoder"]
    assert spike["module_ratios"]["encoder"] == pytest.approx(500.0 / 1.01, rel=0.02)
    assert "grew most in encoder (x" in spike["detail"]
    assert "look at that part of the model and at this step's batch" in spike["detail"]


def test_spike_rules_name_no_group_before_any_level_was_sampled(tmp_path: Path) -> None:
    harness = Judges(tmp_path, spike_warmup_steps=5)
    for step in range(6):
        harness.grads(step, 1.0 + 0.01 * (step % 3))
    harness.grads(6, 500.0)
    (spike,) = harness.anomalies("grad_spike")
    assert "modules" not in spike and "grew most" not in spike["detail"]
