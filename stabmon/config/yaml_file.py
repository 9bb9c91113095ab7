"""Reading a config file safely: a regular file only, bounded in size, and YAML bounded in
nodes, aliases and depth, never blocking on a FIFO; and showing a bad value short and safe.

The run directory and the config a job names may sit on a shared node: a wrong path can
name a log, a dataset, a FIFO or a file another user wrote.
"""

from __future__ import annotations

import os
import reprlib
import stat
from collections.abc import Mapping
from typing import Any

import yaml

from stabmon.errors import ConfigError
from stabmon.shared.safefs import read_at_most

__all__ = ["encodable", "read_yaml", "show"]

_MAX_FILE_BYTES = 1024 * 1024  # 1 MiB: a config is a few dozen lines
# A config is a few dozen flat keys; anything far beyond is an attack or an accident
# (a 414-byte alias bomb expands to billions of nodes when walked).
_MAX_YAML_NODES = 10_000
_MAX_YAML_ALIASES = 100
_MAX_YAML_DEPTH = 32


def _unreadable(error: OSError, advice: str, path: str) -> ConfigError:
    return ConfigError(
        f"cannot read config file ({error.strerror or error}); {advice}", key=None, source=path
    )


def read_yaml(path: str, advice: str) -> Mapping[Any, Any]:
    """The top-level mapping of the YAML config file at ``path``; ``advice`` ends each error
    (what the user should check). Raises :class:`~stabmon.errors.ConfigError`."""
    document = _parse(_read_bytes(path, advice), path)
    if document is None:  # empty, or only comments
        return {}
    if not isinstance(document, dict):
        raise ConfigError(
            f"expected a mapping of keys to values at the top level, got a "
            f"{type(document).__name__}; write one 'key: value' per line",
            key=None,
            source=path,
            allowed="a YAML mapping",
        )
    return document


def _read_bytes(path: str, advice: str) -> bytes:
    too_large = f"config file is larger than 1 MiB, too large for a stabmon config; {advice}"
    if "\0" in path or not encodable(path):
        raise ConfigError(
            f"the path holds a NUL byte or is not valid UTF-8; {advice}",
            key=None,
            source=show(path),
        )
    try:
        # Never blocking: a FIFO named as the config would hang attach() for ever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"config file not found; {advice}", key=None, source=path) from None
    except OSError as error:
        raise _unreadable(error, advice, path) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ConfigError(
                f"cannot read config file (Is a directory); {advice}", key=None, source=path
            )
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(
                f"not a regular file (a FIFO or device); {advice}",
                key=None,
                source=path,
            )
        # Refuse before reading: a wrong path can name a log or a dataset.
        if info.st_size > _MAX_FILE_BYTES:
            raise ConfigError(too_large, key=None, source=path)
        data = read_at_most(fd, _MAX_FILE_BYTES)
    except OSError as error:
        raise _unreadable(error, advice, path) from None
    finally:
        os.close(fd)
    if len(data) > _MAX_FILE_BYTES:  # grew while read
        raise ConfigError(too_large, key=None, source=path)
    return data


def _parse(data: bytes, path: str) -> object:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file is not UTF-8 text (bad byte at offset {error.start})",
            key=None,
            source=path,
        ) from None
    try:
        loader = _LimitedLoader(text)
        try:
            document = loader.get_single_data()
        finally:
            loader.dispose()
    except _TooLarge as error:
        raise ConfigError(
            f"{error}; a config is a flat list of keys", key=None, source=path
        ) from None
    except yaml.constructor.ConstructorError as error:
        raise ConfigError(
            f"unsupported YAML{_position(error)}: {error.problem}; a config holds plain "
            "strings, numbers, booleans, null and mappings, and tags such as "
            "!!python/object are not allowed",
            key=None,
            source=path,
        ) from None
    except yaml.MarkedYAMLError as error:
        raise ConfigError(
            f"malformed YAML{_position(error)}: {error.problem}", key=None, source=path
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"malformed YAML: {show(str(error))}", key=None, source=path) from None
    except (ValueError, RecursionError, OverflowError) as error:
        # An integer of more than 4300 digits, a nesting deeper than Python's stack.
        raise ConfigError(
            f"a value cannot be read ({type(error).__name__}: {show(str(error))})",
            key=None,
            source=path,
        ) from None
    return document


class _TooLarge(Exception):
    """A YAML document over the node, alias or depth limit."""


class _LimitedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with bounded nodes, aliases and nesting, checked while composing.

    Aliases share one node, so a small file can describe a structure of billions
    of nodes (the "billion laughs"); walking it (a message that shows the value)
    is then exponential. Depth is bounded before Python's stack is.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._nodes = 0
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > _MAX_YAML_ALIASES:
                raise _TooLarge(f"more than {_MAX_YAML_ALIASES} YAML aliases (*name)")
        self._nodes += 1
        if self._nodes > _MAX_YAML_NODES:
            raise _TooLarge(f"more than {_MAX_YAML_NODES} YAML nodes")
        self._depth += 1
        try:
            if self._depth > _MAX_YAML_DEPTH:
                raise _TooLarge(f"nested more than {_MAX_YAML_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _position(error: yaml.MarkedYAMLError) -> str:
    mark = error.problem_mark
    return "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"


def show(value: object, *, typed: bool = False) -> str:
    """Render a bad value for a message: short, and safe for huge integers and deep nesting.

    A container is shown two levels deep at most (reprlib): a shared, aliased or
    deeply nested structure must cost a message nothing.
    """
    if isinstance(value, int) and value.bit_length() > 64:
        text = f"<an integer of {value.bit_length()} bits>"
    else:
        try:
            text = _REPR.repr(value) if isinstance(value, _CONTAINERS) else repr(value)[:200]
        except Exception:  # a huge integer inside a list, a hostile __repr__
            text = f"<a {type(value).__name__}>"
        if len(text) > 60:
            text = text[:57] + "..."
    return f"{text} ({type(value).__name__})" if typed else text


_CONTAINERS = (list, tuple, dict, set, frozenset, Mapping)
_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
_REPR.maxstring = _REPR.maxother = 40
