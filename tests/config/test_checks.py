"""stabmon.config.checks through its own interface: one value against one field's spec, with
the error a user reads (load_config's end-to-end cases are in tests/config/test_config.py)."""

from __future__ import annotations

import math

import pytest

from stabmon.config.checks import Spec, check_value, expected
from stabmon.errors import ConfigError


def test_expected_describes_the_range_or_the_choices() -> None:
    assert expected(Spec(int, False, {"ge": 0, "le": 65535})) == "an integer from 0 to 65535"
    assert expected(Spec(float, False, {"gt": 0})) == "a number > 0"
    assert expected(Spec(str, False, {"choices": ("a", "b")})) == "one of 'a', 'b'"


def test_check_value_widens_an_int_for_a_float_field_and_keeps_none_when_optional() -> None:
    assert check_value(Spec(float, False, {}), 3, key="k", source="s") == 3.0
    assert check_value(Spec(int, True, {}), None, key="k", source="s") is None


@pytest.mark.parametrize(
    ("spec", "value", "message"),
    [
        (Spec(int, False, {"ge": 1}), 0, r"stall in run\.yaml: expected an integer >= 1, got 0"),
        (Spec(int, False, {}), "9400", "got '9400' \\(str\\); write it without quotes"),
        (Spec(int, False, {}), True, "expected an integer, got True"),
        (Spec(float, False, {}), math.inf, "expected a finite number, got inf"),
        (Spec(str, False, {"choices": ("warn", "raise")}), "log", "expected one of 'warn'"),
        (Spec(str, False, {}), "a\0b", "without NUL bytes"),
    ],
)
def test_check_value_says_what_was_wrong_and_what_the_field_takes(
    spec: Spec, value: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_value(spec, value, key="stall", source="run.yaml")
