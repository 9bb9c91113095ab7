"""stabmon.detectors.nonfinite: non-finite gradients and losses, one anomaly per episode.

Host values go in as the readback delivers them (tests/judges.py); the records are read
back from the real event log."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.judges import Judges


@pytest.fixture
def harness(tmp_path: Path) -> Judges:
    return Judges(tmp_path)


def test_nonfinite_records_one_anomaly_per_nonfinite_gradient_episode_and_counts_every_step(
    harness: Judges,
) -> None:
    for step in range(3):
        harness.grads(step, 1.0)
    for step in range(3, 7):
        harness.grads(step, float("nan"))
    (anomaly,) = harness.anomalies("nonfinite_grad")
    assert (anomaly["step"], anomaly["modules"], anomaly["parameters"]) == (
        3,
        ["encoder"],
        ["encoder.weight"],
    )
    assert harness.readings.nonfinite_grad_steps == 4
    assert harness.readings.anomalies["nonfinite_grad"] == 1


def test_nonfinite_ends_a_nonfinite_gradient_episode_after_the_gap_of_finite_steps(
    harness: Judges,
) -> None:
    harness.grads(0, float("inf"))
    harness.grads(1, float("inf"))
    for step in range(2, 6):
        harness.grads(step, 1.0)
    (end,) = harness.records("nonfinite_grad_end")
    assert (end["first_step"], end["last_step"], end["count"], end["modules"]) == (
        0,
        1,
        2,
        ["encoder"],
    )


def test_nonfinite_closes_an_open_nonfinite_loss_episode_at_flush(harness: Judges) -> None:
    harness.loss(0, 1.0)
    harness.loss(1, float("nan"))
    harness.loss(2, float("nan"))
    assert harness.records("nonfinite_loss_end") == []
    harness.finish()
    (end,) = harness.records("nonfinite_loss_end")
    assert (end["first_step"], end["last_step"], end["count"]) == (1, 2, 2)
    assert harness.readings.nonfinite_losses == 2
    assert len(harness.anomalies("nonfinite_loss")) == 1


def test_nonfinite_message_names_the_groups_and_the_first_parameters(harness: Judges) -> None:
    harness.grads(0, 1.0)
    harness.grads(1, float("nan"))
    (anomaly,) = harness.anomalies("nonfinite_grad")
    assert "in module group(s) encoder (first parameters encoder.weight)" in anomaly["detail"]
    assert "look at step 1's batch and learning rate" in anomaly["detail"]
