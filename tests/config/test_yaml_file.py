"""stabmon.config.yaml_file through its own interface: a config file read safely and bounded, and
a bad value shown short (load_config's end-to-end cases are in tests/config/test_config.py and
tests/security/test_config_input.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stabmon.config.yaml_file import read_yaml, show
from stabmon.errors import ConfigError


def test_read_yaml_gives_the_top_level_mapping_and_nothing_for_an_empty_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("stall_seconds: 5\nthroughput:\n  record_seconds: 60\n")
    assert read_yaml(str(path), "check the path") == {
        "stall_seconds": 5,
        "throughput": {"record_seconds": 60},
    }
    path.write_text("# only a comment\n")
    assert read_yaml(str(path), "check the path") == {}


def test_read_yaml_refuses_a_fifo_without_blocking_and_ends_with_the_advice(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file .*; check STABMON_CONFIG"):
        read_yaml(str(fifo), "check STABMON_CONFIG")


def test_read_yaml_refuses_a_file_over_one_mib_before_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "dataset.csv"
    path.write_bytes(b"a: 1\n" + b"#" * (1024 * 1024))
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        read_yaml(str(path), "check the path")


def test_read_yaml_refuses_a_top_level_list_saying_what_a_config_looks_like(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("- stall_seconds\n- 5\n")
    with pytest.raises(ConfigError, match="got a list; write one 'key: value' per line"):
        read_yaml(str(path), "check the path")


def test_read_yaml_refuses_a_python_tag(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("port: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="unsupported YAML at line 1"):
        read_yaml(str(path), "check the path")


def test_show_keeps_a_huge_integer_and_a_deep_container_short() -> None:
    assert show(10**400) == "<an integer of 1329 bits>"
    nested: list[object] = []
    for _ in range(50):
        nested = [nested]
    assert len(show(nested)) <= 60
    assert show("text", typed=True) == "'text' (str)"
