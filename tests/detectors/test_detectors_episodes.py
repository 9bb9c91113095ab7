"""stabmon.detectors.episodes: consecutive bad values are one episode. (Named after its
package: tests/test_episodes.py holds the basename, with the Monitor-level episode tests.)"""

from __future__ import annotations

import pytest

from stabmon.detectors.episodes import EpisodeChange, Episodes


def test_an_episode_starts_at_the_first_bad_value() -> None:
    episodes = Episodes(gap=3)
    assert episodes.update(0, bad=False) is None
    assert episodes.update(1, bad=True) == EpisodeChange(True, 1, 1, 1)
    assert episodes.active


def test_further_bad_values_extend_the_episode_silently() -> None:
    episodes = Episodes(gap=3)
    episodes.update(5, bad=True)
    assert [episodes.update(step, bad=True) for step in (6, 7)] == [None, None]


def test_an_episode_ends_after_gap_good_values_in_a_row_naming_its_last_bad_step() -> None:
    episodes = Episodes(gap=3)
    for step in (10, 11, 12):
        episodes.update(step, bad=True)
    assert episodes.update(13, bad=False) is None
    assert episodes.update(14, bad=False) is None
    assert episodes.update(15, bad=False) == EpisodeChange(False, 10, 3, 12)
    assert not episodes.active


def test_a_bad_value_within_the_gap_keeps_the_episode_open() -> None:
    episodes = Episodes(gap=2)
    episodes.update(0, bad=True)
    episodes.update(1, bad=False)
    assert episodes.update(2, bad=True) is None  # not a new start
    episodes.update(3, bad=False)
    assert episodes.update(4, bad=False) == EpisodeChange(False, 0, 2, 2)


def test_a_new_episode_after_an_end_starts_again() -> None:
    episodes = Episodes(gap=1)
    episodes.update(0, bad=True)
    episodes.update(1, bad=False)
    assert episodes.update(9, bad=True) == EpisodeChange(True, 9, 1, 9)


def test_close_ends_an_open_episode_once() -> None:
    episodes = Episodes(gap=100)
    episodes.update(3, bad=True)
    episodes.update(4, bad=True)
    assert episodes.close() == EpisodeChange(False, 3, 2, 4)
    assert episodes.close() is None


def test_a_gap_below_one_is_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match="gap must be a number of values >= 1, got 0"):
        Episodes(gap=0)
