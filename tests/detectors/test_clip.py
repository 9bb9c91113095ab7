"""stabmon.detectors.clip: the clip coefficient, whichever of clip and norm comes first.

Host values go in as the readback delivers them (tests/judges.py); the records are read
back from the real event log."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.judges import Judges


@pytest.fixture
def harness(tmp_path: Path) -> Judges:
    return Judges(tmp_path)


@pytest.mark.parametrize("clip_first", [True, False])
def test_clip_judge_computes_the_clip_coefficient_whichever_of_clip_and_norm_comes_first(
    harness: Judges, clip_first: bool
) -> None:
    if clip_first:
        harness.clip(0, 1.0)
    harness.grads(0, 3.0, 4.0)  # total 5
    if not clip_first:
        harness.clip(0, 1.0)
    assert harness.readings.grad_clip_coefficient == pytest.approx(0.2)
    assert harness.readings.grad_clipped_steps == 1


def test_clip_judge_reports_coefficient_one_for_a_step_the_clip_left_alone(harness: Judges) -> None:
    harness.clip(0, 10.0)
    harness.grads(0, 3.0, 4.0)
    harness.grads(1, 3.0, 4.0)  # no clip call in step 1
    assert harness.readings.grad_clip_coefficient == 1.0
    assert harness.readings.grad_clipped_steps == 0
