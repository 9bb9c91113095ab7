"""The generic engine behind ``stabmon.config``: checked dataclass sections loaded from YAML.

``stabmon/config/__init__.py`` declares what can be configured (the ``Config`` dataclasses, their
defaults and a doc per field); this module knows nothing of those keys. It turns any
tree of frozen ``Section`` dataclasses into a loader:

- ``field_meta`` puts a field's doc and constraint in its metadata (``gt``, ``ge``,
  ``lt``, ``le``, ``nonempty``, ``max_length``, ``choices``, ``pattern``, and ``env``
  for the variable that sets it);
- ``Section.__post_init__`` checks every field on direct construction, as
  ``load_sections`` checks every value from a file, a mapping, the environment or
  overrides: one checker reads the annotations and the metadata, so a new field or a
  nested section needs no loader code;
- YAML is read safely and bounded (:mod:`stabmon.config.yaml_file`);
- every error is a ``ConfigError`` that reads ``<dotted key> in <source>: <problem>``
  and shows the bad value short and safe (huge integers, deep or aliased nesting).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from stabmon.config.checks import DECIMAL, TEXT_FORMS, TYPE_NAMES, Spec, check_value, expected
from stabmon.config.yaml_file import read_yaml
from stabmon.config.yaml_file import show as _show
from stabmon.errors import ConfigError

__all__ = ["Section", "field_meta", "load_sections"]

_MAPPING_SOURCE = "config mapping"
_OVERRIDE_SOURCE = "attach() keyword argument"
_TRUE_WORDS = frozenset({"true", "yes", "1"})
_FALSE_WORDS = frozenset({"false", "no", "0"})


class Section:
    """What every config section shares: validation on construction, and ``to_dict``."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        # Config(port=-1) must fail as load_config would, not later inside a thread.
        source = f"{type(self).__name__}()"
        for name, spec in _specs(type(self)).items():
            value = getattr(self, name)
            if spec.section:
                if not isinstance(value, spec.kind):
                    raise ConfigError(
                        f"expected a {spec.kind.__name__}, got {_show(value, typed=True)}; "
                        "use load_config() to build a config from a mapping",
                        key=name,
                        source=source,
                        allowed=spec.kind.__name__,
                    )
                continue
            checked = check_value(spec, value, key=name, source=source)
            if type(checked) is not type(value):
                # An int given for a float field is stored as a float; frozen, hence object.
                object.__setattr__(self, name, checked)

    def to_dict(self) -> dict[str, Any]:
        """Return the config as a plain nested dict of JSON-able values, e.g. for logging."""
        return dataclasses.asdict(self)


def field_meta(
    doc: str,
    *,
    env: str | None = None,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    nonempty: bool = False,
    max_length: int | None = None,
    choices: tuple[str, ...] | None = None,
    pattern: str | None = None,
) -> dict[str, Any]:
    """Field metadata: the doc and the constraint (keywords, so a misspelt rule fails)."""
    rules = {
        "env": env,
        "gt": gt,
        "ge": ge,
        "lt": lt,
        "le": le,
        "max_length": max_length,
        "choices": choices,
        "pattern": pattern,
    }
    meta = {"doc": doc} | {name: rule for name, rule in rules.items() if rule is not None}
    return meta | ({"nonempty": True} if nonempty else {})


_SectionT = TypeVar("_SectionT", bound=Section)
_SPEC_MEMO: dict[type[Section], Mapping[str, Spec]] = {}


def _specs(cls: type[Section]) -> Mapping[str, Spec]:
    """The fields of ``cls`` as the checker sees them, read once per class.

    Memoised because resolving the annotations (``typing.get_type_hints`` compiles each
    one) was most of the cost of a ``load_config`` call, and a class's fields do not
    change. The memo holds one entry per section class defined in code.
    """
    cached = _SPEC_MEMO.get(cls)
    if cached is None:
        cached = _SPEC_MEMO[cls] = _read_specs(cls)
    return cached


def _read_specs(cls: type[Section]) -> Mapping[str, Spec]:
    hints = typing.get_type_hints(cls)
    specs = {}
    for f in dataclasses.fields(cls):
        members = typing.get_args(hints[f.name]) or (hints[f.name],)
        kinds = [member for member in members if member is not type(None)]
        if len(kinds) != 1 or not (kinds[0] in TYPE_NAMES or _is_section(kinds[0])):
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported annotation {hints[f.name]}")
        specs[f.name] = Spec(
            kinds[0], len(kinds) != len(members), f.metadata, section=_is_section(kinds[0])
        )
    return types.MappingProxyType(specs)


def _is_section(kind: object) -> typing.TypeGuard[type[Section]]:
    return isinstance(kind, type) and issubclass(kind, Section)


def load_sections(
    cls: type[_SectionT],
    source: str | os.PathLike[str] | Mapping[str, Any] | Section | None,
    overrides: Mapping[str, Any] | None,
    env: Mapping[str, str] | None,
    *,
    file_variable: str,
) -> _SectionT:
    """Build a ``cls`` from its defaults, ``source``, ``env`` and ``overrides``, in that order.

    ``source`` is a YAML file path, a mapping shaped like the file, a ``cls`` (taken as
    resolved: only ``overrides`` apply), or None (then the file named by the environment
    variable ``file_variable``, if set). ``env`` defaults to ``os.environ``.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    if not isinstance(environ, Mapping):
        raise ConfigError(
            f"expected a mapping of variable names to values, got {_show(environ, typed=True)}",
            key=None,
            source="load_config(env=...)",
            allowed="a mapping",
        )
    layers: list[dict[str, Any]] = []
    if isinstance(source, cls):
        base = source
    else:
        base = cls()
        layers.append(_read_source(cls, source, environ, file_variable))
        layers.append(_read_env(cls, environ))
    if overrides is not None:
        if not isinstance(overrides, Mapping):
            raise ConfigError(
                f"expected a mapping of keys to values, got {_show(overrides, typed=True)}",
                key=None,
                source=_OVERRIDE_SOURCE,
                allowed="a mapping",
            )
        layers.append(_flatten(cls, overrides, source=_OVERRIDE_SOURCE))
    values: dict[str, Any] = {}
    for layer in layers:
        values.update(layer)
    return _apply(base, values)


def _read_source(
    cls: type[Section],
    source: str | os.PathLike[str] | Mapping[str, Any] | Section | None,
    environ: Mapping[str, str],
    file_variable: str,
) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return _flatten(cls, source, source=_MAPPING_SOURCE)
    if source is not None:
        if not isinstance(source, (str, os.PathLike)) or not isinstance(os.fspath(source), str):
            raise ConfigError(
                f"expected a YAML file path, a mapping or a {cls.__name__}, got "
                + _show(source, typed=True),
                key=None,
                source="load_config(source=...)",
                allowed=f"str, os.PathLike[str], Mapping, {cls.__name__} or None",
            )
        path, advice = os.fspath(source), "check the path"
    else:
        path = environ.get(file_variable, "")
        if not path:
            return {}
        advice = f"check environment variable {file_variable}, or unset it"
    return _flatten(cls, read_yaml(path, advice), source=path)


def _read_env(cls: type[Section], environ: Mapping[str, str], prefix: str = "") -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, spec in _specs(cls).items():
        key = prefix + name
        if spec.section:
            values.update(_read_env(spec.kind, environ, key + "."))
            continue
        variable = spec.meta.get("env")
        text = environ.get(variable, "") if variable else ""
        if text and not isinstance(text, str):
            raise ConfigError(
                f"expected text, got {_show(text, typed=True)}",
                key=key,
                source=f"environment variable {variable}",
                allowed=expected(spec),
            )
        if text:
            values[key] = _from_text(spec, text, key=key, source=f"environment variable {variable}")
    return values


def _from_text(spec: Spec, text: str, *, key: str, source: str) -> Any:
    word = text.strip()
    value: Any = text
    if spec.kind is bool and word.lower() in _TRUE_WORDS | _FALSE_WORDS:
        value = word.lower() in _TRUE_WORDS
    elif spec.kind is int and DECIMAL.fullmatch(word):
        try:
            value = int(word)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise ConfigError(
                f"expected {TEXT_FORMS[spec.kind]}, got {len(word)} digits",
                key=key,
                source=source,
                allowed=expected(spec),
            ) from None
    elif spec.kind is float:
        try:
            value = float(word)
        except ValueError:
            pass
    if spec.kind is not str and isinstance(value, str):
        raise ConfigError(
            f"expected {TEXT_FORMS[spec.kind]}, got {_show(text)}",
            key=key,
            source=source,
            allowed=expected(spec),
        )
    return check_value(spec, value, key=key, source=source)


def _flatten(
    cls: type[Section], mapping: Mapping[Any, Any], *, source: str, prefix: str = ""
) -> dict[str, Any]:
    """Check every key and value of ``mapping`` and return them by dotted key."""
    specs = _specs(cls)
    allowed = ", ".join(prefix + name for name in sorted(specs))
    values: dict[str, Any] = {}
    for raw_key, value in mapping.items():
        if not isinstance(raw_key, str):
            raise ConfigError(
                f"keys must be strings, got {_show(raw_key, typed=True)}",
                key=prefix[:-1] or None,
                source=source,
                allowed=allowed,
            )
        name, dotted, rest = raw_key.partition(".")
        key = prefix + name
        spec = specs.get(name)
        if spec is None:
            close = difflib.get_close_matches(name, list(specs), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ";"
            raise ConfigError(
                f"unknown key{hint} allowed: {allowed}",
                key=prefix + raw_key,
                source=source,
                allowed=allowed,
            )
        if spec.section:
            section = {rest: value} if dotted else _section_mapping(spec, value, key, source)
            values.update(_flatten(spec.kind, section, source=source, prefix=key + "."))
        elif dotted:
            raise ConfigError(
                f"unknown key; {key} is a single value, not a section",
                key=prefix + raw_key,
                source=source,
                allowed=allowed,
            )
        else:
            values[key] = check_value(spec, value, key=key, source=source)
    return values


def _section_mapping(spec: Spec, value: object, key: str, source: str) -> Mapping[Any, Any]:
    if isinstance(value, spec.kind):
        return typing.cast(Section, value).to_dict()
    if isinstance(value, Mapping):
        return value
    raise ConfigError(
        f"expected a mapping of {key}.* keys, got {_show(value, typed=True)}",
        key=key,
        source=source,
        allowed="a mapping",
    )


def _apply(base: _SectionT, values: Mapping[str, Any], prefix: str = "") -> _SectionT:
    """Return ``base`` with the dotted ``values`` under ``prefix`` replaced."""
    changes: dict[str, Any] = {}
    for name, spec in _specs(type(base)).items():
        key = prefix + name
        if spec.section:
            current = getattr(base, name)
            updated = _apply(current, values, key + ".")
            if updated is not current:
                changes[name] = updated
        elif key in values:
            changes[name] = values[key]
    return dataclasses.replace(base, **changes) if changes else base
