"""Who marks the end of an epoch: the user, a tracked loader, or a count of steps.

Memory baselines, leak windows and the epoch gauge move at epoch ends, so a loop must
get them whatever its shape. In order of precedence:

- the user's ``epoch_end()``: once called, explicit calls alone mark epochs;
- else a loader passed to ``track()``: the end of a pass in which an optimizer step
  happened (a validation loader's pass marks none);
- else every ``window_steps`` steps (one endless epoch, a ``get_batch()`` loop).

A ``track()`` pass that ends just before the user's ``epoch_end()`` at the same step is
one boundary, marked once. The choice survives a resume (``state()``/``load()``).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["EpochMarks"]

MarkedBy = Literal["user", "loader", "steps"]


class EpochMarks:
    """The epoch policy of one Monitor (state only: the Monitor closes the epochs)."""

    def __init__(self) -> None:
        #: Set by the first epoch_end(): only explicit calls mark epochs from then on.
        self.by_user = False
        #: Set by track(): a pass's end marks the epoch (unless by_user).
        self.by_loader = False
        self._loader_closed_at: int | None = None

    def by_steps(self) -> bool:
        """Whether a window of ``window_steps`` steps marks an epoch (nobody else does)."""
        return not (self.by_user or self.by_loader)

    def user_marks(self, steps: int) -> bool:
        """``epoch_end()`` at ``steps``: whether it closes an epoch (not one a pass just closed)."""
        self.by_user = True
        return self._loader_closed_at != steps

    def pass_ended(self, steps_at_start: int, steps: int) -> bool:
        """A tracked pass is exhausted: whether it closes an epoch (a step happened in it)."""
        if self.by_user or steps <= steps_at_start:
            return False
        self._loader_closed_at = steps
        return True

    def state(self) -> MarkedBy:
        return "user" if self.by_user else "loader" if self.by_loader else "steps"

    def load(self, marked_by: object) -> None:
        """After a resume: a run whose user marked epochs keeps doing so."""
        if marked_by == "user":
            self.by_user = True
