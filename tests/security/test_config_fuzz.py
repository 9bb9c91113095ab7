"""Issue 21: fuzzing ``load_config`` over files, overrides and the environment.

Whatever the input (random text, YAML built from hostile fragments, aliases,
tags, huge numbers, NUL bytes, lone surrogates, nested structures), only a
``ConfigError`` may escape, and each case stays within 100 MB (tracemalloc)
and 1 s of CPU time (the thread's own, which a busy machine does not stretch as
it stretches wall time). The fast run takes a few hundred cases; the ``slow``
run takes 10,000.
"""

from __future__ import annotations

import os
import tempfile
import time
import tracemalloc
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stabmon.config import Config, load_config
from stabmon.errors import ConfigError

_MEMORY_LIMIT = 100 * 2**20
#: Per case, in this thread's CPU time: a busy machine stretches wall time, not the work done.
_CPU_SECONDS_LIMIT = 1.0
_KEYS = [
    *(name for name in Config.__dataclass_fields__ if name != "daemon"),
    "daemon", "daemon.port", "daemon.address", "daemon.interval",
]  # fmt: skip
_VARIABLES = ["STABMON_RUN_ID", "STABMON_PORT", "STABMON_DIR", "STABMON_CONFIG"]
_FRAGMENTS = [
    "[", "]", "{", "}", ", ", ": ", "- ", "\n", "  ", "&a ", "*a", "&b ", "*b", "<<: *a\n",
    "!!python/object/apply:os.system ['true']", "!!binary aGk=", "!!set {a}", "? ", "|\n  x",
    "'", '"', "\\", "\0", "\t", "#", "%YAML 1.1\n---\n", "...\n", "---\n", "\ud800",
    "9" * 5000, "1e999", "-1", "0x1F", ".inf", ".nan", "~", "null", "yes", "no", "on",
    *(f"{key}: " for key in _KEYS), "daemon:\n  ", "run_id: ../..", "run_dir: /tmp/\0",
]  # fmt: skip

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=0, max_value=6000).map(lambda digits: 10**digits),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=64),
    st.binary(max_size=32).map(os.fsdecode),  # undecodable bytes become lone surrogates
)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    )


# Override values nest three deep: a section (daemon) whose values are containers. Deeper
# nesting reaches no other code (a container where a scalar belongs is refused at any depth;
# test_config_input.py feeds overrides nested 10,000 deep and YAML 5,000 deep); st.recursive made
# generation, not load_config, most of each case's time.
_values = st.one_of(_scalars, _containers(_scalars), _containers(_containers(_scalars)))
_yaml = st.one_of(
    st.text(max_size=500),
    st.lists(st.sampled_from(_FRAGMENTS), max_size=120).map("".join),
    st.binary(max_size=300).map(lambda data: data.decode("latin-1")),
)
_overrides = st.one_of(
    st.none(),
    st.dictionaries(st.one_of(st.sampled_from(_KEYS), st.text(max_size=12)), _values, max_size=5),
)
_env = st.dictionaries(
    st.sampled_from(_VARIABLES),
    st.one_of(
        st.text(max_size=64),
        st.binary(max_size=64).map(os.fsdecode),
        st.integers(min_value=0, max_value=6000).map(lambda digits: "7" * digits),
    ),  # fmt: skip
    max_size=4,
)


def _check_one(text: str, overrides: Mapping[str, Any] | None, env: Mapping[str, str]) -> None:
    with tempfile.NamedTemporaryFile("wb", suffix=".yaml", delete=False) as file:
        file.write(text.encode("utf-8", "surrogatepass"))
    tracemalloc.start()
    started = time.thread_time()
    try:
        for source in (file.name, None):
            try:
                config = load_config(source, overrides, env)
            except ConfigError:
                continue
            assert isinstance(config, Config)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        os.unlink(file.name)
    assert peak < _MEMORY_LIMIT, f"{peak / 2**20:.0f} MB for one case"
    cpu_seconds = time.thread_time() - started
    assert cpu_seconds < _CPU_SECONDS_LIMIT, f"{cpu_seconds:.2f} s of CPU for one case"


@settings(database=None, max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(text=_yaml, overrides=_overrides, env=_env)
def test_load_config_lets_only_config_error_escape_any_input(
    text: str, overrides: Mapping[str, Any] | None, env: Mapping[str, str]
) -> None:
    _check_one(text, overrides, env)


@pytest.mark.slow
@settings(database=None, max_examples=10_000, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(text=_yaml, overrides=_overrides, env=_env)
def test_load_config_lets_only_config_error_escape_ten_thousand_inputs_each_within_a_second(
    text: str, overrides: Mapping[str, Any] | None, env: Mapping[str, str]
) -> None:
    _check_one(text, overrides, env)
