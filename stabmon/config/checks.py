"""Checking one config value against its field: type, bounds, choices, pattern, text.

The loader (:mod:`stabmon.config.loading`) reads each field of a section into a
:class:`Spec` once per class; :func:`check_value` is every check of a value, wherever it
came from (a file, the environment, overrides, direct construction), with an error that
says what the field accepts.
"""

from __future__ import annotations

import math
import operator
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stabmon.config.yaml_file import encodable, show
from stabmon.errors import ConfigError

__all__ = ["BOUNDS", "DECIMAL", "TEXT_FORMS", "TYPE_NAMES", "Spec", "check_value", "expected"]

TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
TEXT_FORMS = {bool: "true, false, yes, no, 1 or 0", int: "a decimal integer", float: "a number"}
DECIMAL = re.compile(r"[+-]?[0-9]+")
#: Metadata keys of numeric bounds, in the order messages name them.
BOUNDS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "gt": (operator.gt, ">"),
    "ge": (operator.ge, ">="),
    "lt": (operator.lt, "<"),
    "le": (operator.le, "<="),
}


@dataclass(frozen=True)
class Spec:
    """One field as the checker sees it: a bool/int/float/str or section type, and rules.

    What every check of the field asks (is it a section, which types it accepts, its
    numeric bounds) is worked out here once: a section is checked whole on every
    construction, and ``load_config`` constructs each a few times (defaults, file,
    environment, overrides).
    """

    kind: type
    optional: bool
    meta: Mapping[str, Any]
    #: Whether ``kind`` is a nested section (decided by the loader, which knows Section).
    section: bool = field(default=False, repr=False, compare=False)
    # Derived from the three above in __post_init__.
    accepted: tuple[type, ...] = field(init=False, repr=False, compare=False)
    bounds: tuple[tuple[Callable[[Any, Any], bool], Any], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        bounds = tuple(
            (compare, self.meta[name]) for name, (compare, _) in BOUNDS.items() if name in self.meta
        )
        object.__setattr__(self, "accepted", (int, float) if self.kind is float else (self.kind,))
        object.__setattr__(self, "bounds", bounds)


def check_value(spec: Spec, value: Any, *, key: str, source: str) -> Any:
    """Return ``value`` (ints widened for float fields) or raise if type or range is off."""
    if value is None and spec.optional:
        return None
    or_none = " or None" if spec.optional else ""
    if not isinstance(value, spec.accepted) or (spec.kind is not bool and isinstance(value, bool)):
        raise ConfigError(
            f"expected {TYPE_NAMES[spec.kind]}{or_none}, got {show(value, typed=True)}"
            + _quote_hint(spec, value),
            key=key,
            source=source,
            allowed=expected(spec) + or_none,
        )
    checked = value
    if spec.kind is float:
        try:
            checked = float(typing.cast(float, value))
        except OverflowError:
            checked = math.inf
        if not math.isfinite(checked):
            raise ConfigError(
                f"expected a finite number, got {show(value)}",
                key=key,
                source=source,
                allowed=expected(spec) + or_none,
            )
    if isinstance(checked, str) and ("\0" in checked or not encodable(checked)):
        raise ConfigError(
            "expected text without NUL bytes that is valid UTF-8 (a value taken from bytes "
            f"in another encoding?), got {show(checked)}",
            key=key,
            source=source,
            allowed=expected(spec) + or_none,
        )
    if not _within(spec, checked):
        long_text = isinstance(value, str) and bool(value) and "choices" not in spec.meta
        shown = f"{len(str(value))} characters" if long_text else show(value)
        raise ConfigError(
            f"expected {expected(spec)}, got {shown}",
            key=key,
            source=source,
            allowed=expected(spec) + or_none,
        )
    pattern = spec.meta.get("pattern")
    if isinstance(checked, str) and pattern is not None and not re.fullmatch(pattern, checked):
        raise ConfigError(
            "expected letters, digits, '.', '_' and '-' only, not starting with '.' (it names "
            f"a directory), got {show(checked)}",
            key=key,
            source=source,
            allowed=f"text matching {pattern}" + or_none,
        )
    return checked


def _within(spec: Spec, value: Any) -> bool:
    if isinstance(value, str):
        meta = spec.meta
        if "choices" in meta:
            return value in meta["choices"]
        too_long = len(value) > meta.get("max_length", len(value))
        return not too_long and not (meta.get("nonempty") and not value)
    for compare, bound in spec.bounds:
        if not compare(value, bound):
            return False
    return True


def expected(spec: Spec) -> str:
    """Describe what a field accepts, e.g. 'an integer from 0 to 65535'."""
    meta = spec.meta
    if spec.kind is str:
        if "choices" in meta:
            return "one of " + ", ".join(repr(choice) for choice in meta["choices"])
        phrase = "a non-empty string" if meta.get("nonempty") else "a string"
        if "max_length" in meta:
            phrase += f" of at most {meta['max_length']} characters"
        return phrase
    phrase = TYPE_NAMES[spec.kind]
    if "ge" in meta and "le" in meta:
        return f"{phrase} from {meta['ge']} to {meta['le']}"
    bounds = [f"{symbol} {meta[name]}" for name, (_, symbol) in BOUNDS.items() if name in meta]
    return " ".join([phrase, " and ".join(bounds)]) if bounds else phrase


def _quote_hint(spec: Spec, value: object) -> str:
    """Suggest dropping the quotes from a number written as text, as in ``port: "9400"``."""
    if not isinstance(value, str) or spec.kind not in (int, float):
        return ""
    if spec.kind is int:
        return "; write it without quotes" if DECIMAL.fullmatch(value.strip()) else ""
    try:
        float(value)
    except ValueError:
        return ""
    return "; write it without quotes"
