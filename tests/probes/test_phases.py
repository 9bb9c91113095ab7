"""stabmon.probes.phases: the user's phase names, bounded before they become label values."""

from __future__ import annotations

import logging

import pytest

from stabmon.contract import PHASES
from stabmon.probes.phases import MAX_NAMED_PHASES, PhaseNames
from stabmon.shared.log import LogLimiter


@pytest.fixture
def names() -> PhaseNames:
    return PhaseNames(LogLimiter())


def test_a_short_identifier_is_its_own_label(names: PhaseNames) -> None:
    assert names.label("eval") == "eval"
    assert names.label("eval") == "eval"
    assert names.label("_checkpoint_2") == "_checkpoint_2"


@pytest.mark.parametrize("bad", ["", "2eval", "eval-loop", "a" * 65, "step 1", "é"])
def test_a_name_that_is_not_a_short_identifier_is_counted_as_other(
    names: PhaseNames, bad: str
) -> None:
    assert names.label(bad) == "other"


def test_a_name_that_is_not_a_string_is_counted_as_other(names: PhaseNames) -> None:
    assert names.label(3) == "other"  # type: ignore[arg-type]


def test_a_built_in_loop_phase_cannot_be_taken_as_a_name(names: PhaseNames) -> None:
    for phase in (*PHASES, "startup"):
        assert names.label(phase) == "other"


def test_names_beyond_the_bound_share_other_while_known_names_keep_theirs(
    names: PhaseNames,
) -> None:
    labels = [names.label(f"phase{i}") for i in range(MAX_NAMED_PHASES + 3)]
    assert labels[:MAX_NAMED_PHASES] == [f"phase{i}" for i in range(MAX_NAMED_PHASES)]
    assert labels[MAX_NAMED_PHASES:] == ["other"] * 3
    assert names.label("phase0") == "phase0"


def test_a_bad_name_is_warned_about_once(
    names: PhaseNames, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        names.label("step-1")
        names.label("step-2")
    (record,) = caplog.records
    assert "'step-1' is not a short identifier" in record.getMessage()
    assert "counted as phase 'other'" in record.getMessage()
