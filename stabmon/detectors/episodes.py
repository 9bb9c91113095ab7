"""Episodes: consecutive bad values (non-finite gradients or losses) are one incident.

A poisoned model is non-finite at every step from then on; one record per step
would flood the event log and page once per step. An episode starts at the
first bad value and ends after ``gap`` good values in a row; the caller records
its start (an anomaly) and its end (first step, count, last step).

    episodes = Episodes(gap=20)
    change = episodes.update(step, bad=not math.isfinite(loss))
    if change is not None and change.started:
        print("non-finite since", change.first_step)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EpisodeChange", "Episodes"]


@dataclass(frozen=True)
class EpisodeChange:
    """An episode that started (``started``) or ended (not ``started``) at this value."""

    started: bool
    first_step: int
    #: Bad values in the episode so far (1 when it starts).
    count: int
    #: The last bad step of the episode.
    last_step: int


class Episodes:
    """Groups bad values into episodes; a few numbers of state."""

    def __init__(self, gap: int) -> None:
        if gap < 1:
            raise ValueError(f"Episodes gap must be a number of values >= 1, got {gap!r}")
        self._gap = gap
        self._first: int | None = None
        self._last = 0
        self._count = 0
        self._good = 0

    @property
    def active(self) -> bool:
        return self._first is not None

    def update(self, step: int, *, bad: bool) -> EpisodeChange | None:
        """One value; returns the start or the end of an episode, else None."""
        if bad:
            self._good = 0
            if self._first is None:
                self._first, self._last, self._count = step, step, 1
                return EpisodeChange(True, step, 1, step)
            self._last = step
            self._count += 1
            return None
        if self._first is None:
            return None
        self._good += 1
        if self._good < self._gap:
            return None
        return self.close()

    def close(self) -> EpisodeChange | None:
        """End the episode under way now (detach), if any."""
        if self._first is None:
            return None
        change = EpisodeChange(False, self._first, self._count, self._last)
        self._first = None
        self._count = 0
        self._good = 0
        return change
