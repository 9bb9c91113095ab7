"""The epoch policy: the user's epoch_end() over a tracked loader over a count of steps."""

from __future__ import annotations

from stabmon.wiring.epochs import EpochMarks


def test_epoch_marks_fall_back_to_step_windows_until_a_loader_or_the_user_marks_them() -> None:
    marks = EpochMarks()
    assert marks.by_steps() and marks.state() == "steps"
    marks.by_loader = True
    assert not marks.by_steps() and marks.state() == "loader"
    marks.user_marks(10)
    assert marks.state() == "user"


def test_epoch_marks_ignore_a_pass_without_a_step_and_every_pass_once_the_user_marks() -> None:
    marks = EpochMarks()
    assert not marks.pass_ended(steps_at_start=5, steps=5)  # a validation loader's pass
    assert marks.pass_ended(steps_at_start=5, steps=9)
    marks.user_marks(12)
    assert not marks.pass_ended(steps_at_start=12, steps=20)


def test_epoch_marks_count_a_pass_end_and_the_users_call_at_one_step_as_one_epoch() -> None:
    marks = EpochMarks()
    assert marks.pass_ended(steps_at_start=0, steps=30)
    assert not marks.user_marks(30)  # the same boundary
    assert marks.user_marks(60)


def test_epoch_marks_keep_the_users_marking_across_a_resume() -> None:
    marks = EpochMarks()
    marks.load("user")
    assert marks.state() == "user" and not marks.by_steps()
    fresh = EpochMarks()
    fresh.load("loader")  # a loader is tracked again (or not) by the resumed loop itself
    assert fresh.state() == "steps"
