"""Issue 21, item 6: every bad config input is a ConfigError (or one CLI line, exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

import stabmon
from stabmon.config import load_config
from stabmon.errors import ConfigError
from tests.helpers import tiny_model

_CLI = "import sys; from stabmon.cli import main; sys.exit(main(sys.argv[1:]))"


def _bomb(levels: int) -> str:
    lines = ["run_id:", "  - &l0 [x, x, x, x, x, x, x, x, x]"]
    for level in range(1, levels):
        lines.append(f"  - &l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_a_config_error_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(8))  # 72 aliases, 9**8 = 43 million leaves when walked
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match="^run_id in .*: expected a string or None"):
            load_config(path, env={})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20


def test_more_than_a_hundred_aliases_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(13))  # 108 aliases
    with pytest.raises(ConfigError, match="more than 100 YAML aliases"):
        load_config(path, env={})


def test_deep_nesting_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("run_id: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested more than 32 levels"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="^run_id in config mapping: expected a string"):
        nested: list[object] = []
        for _ in range(10_000):
            nested = [nested]
        load_config({"run_id": nested}, env={})


def test_integers_over_4300_digits_are_config_errors_in_yaml_and_in_the_environment(
    tmp_path: Path,
) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("port: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match="big.yaml"):
        load_config(path, env={})
    with pytest.raises(
        ConfigError, match="^port in environment variable STABMON_PORT: .*5000 digits"
    ):
        load_config(None, env={"STABMON_PORT": "9" * 5000})


@pytest.mark.parametrize("key", ["run_dir", "tls_certfile", "basic_auth_file", "address"])
def test_a_nul_byte_in_a_path_or_address_is_a_config_error(key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key} in .*NUL"):
        load_config({key: "/tmp/a\0b"}, env={})


def test_attach_with_a_nul_in_run_dir_raises_config_error_and_binds_nothing() -> None:
    model = tiny_model()
    with pytest.raises(ConfigError, match="run_dir"):
        stabmon.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir="/tmp/x\0y",
                       port=0, address="127.0.0.1")  # fmt: skip


@pytest.mark.parametrize("source", [123, b"/etc/passwd", 1.5, ["a"]])
def test_a_source_of_the_wrong_type_is_a_config_error(source: object) -> None:
    with pytest.raises(ConfigError, match="expected a YAML file path"):
        load_config(source, env={})  # type: ignore[arg-type]


def test_overrides_and_env_of_the_wrong_type_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(None, overrides=[("port", 1)], env={})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="STABMON_PORT"):
        load_config(None, env={"STABMON_PORT": 9400})  # type: ignore[dict-item]


def test_port_attempts_is_bounded() -> None:
    with pytest.raises(ConfigError, match="^port_attempts in"):
        load_config({"port_attempts": 10**9}, env={})


def test_a_run_id_from_non_utf8_bytes_in_the_environment_is_a_config_error() -> None:
    run_id = os.fsdecode(b"run-\xff")  # what Python makes of a non-UTF-8 variable
    with pytest.raises(ConfigError, match="^run_id in environment variable STABMON_RUN_ID"):
        load_config(None, env={"STABMON_RUN_ID": run_id})


@pytest.mark.parametrize("run_id", ["a/b", ".", "..", "../etc", "a\\b", "a b"])
def test_a_run_id_outside_the_safe_alphabet_is_a_config_error(run_id: str) -> None:
    with pytest.raises(ConfigError, match="letters, digits"):
        load_config({"run_id": run_id}, env={})


def test_check_config_on_a_fifo_or_a_bomb_exits_2_with_one_line(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 100_000 + "\n")
    for name in ("fifo.yaml", "deep.yaml"):
        # The timeout guards a hang (today, a FIFO never returns); it asserts no duration.
        result = subprocess.run(
            [sys.executable, "-c", _CLI, "check-config", str(tmp_path / name)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_daemon_with_a_deeply_nested_config_exits_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "deep.yaml").write_text("daemon: " + "[" * 100_000 + "\n")
    result = subprocess.run(
        [sys.executable, "-c", _CLI, "daemon", "--config", str(tmp_path / "deep.yaml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1


_ATTACH_WITH_FIFO = """
import os, sys, torch, stabmon
model = torch.nn.Linear(2, 1)
monitor = stabmon.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), port=0,
                         address="127.0.0.1", run_dir=sys.argv[1], run_id="fifo",
                         **{sys.argv[2]: sys.argv[3]})
print("serving" if monitor.metrics_url else "not serving", flush=True)
monitor.detach()
"""


@pytest.mark.parametrize("key", ["tls_certfile", "basic_auth_file"])
def test_attach_does_not_block_on_a_fifo_named_as_a_security_file(tmp_path: Path, key: str) -> None:
    os.mkfifo(tmp_path / "fifo")
    result = subprocess.run(
        [sys.executable, "-c", _ATTACH_WITH_FIFO, str(tmp_path), key, str(tmp_path / "fifo")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "not serving"  # fail closed, and training went on


# Issue 40: a wait that long is a typo, and past ~2.9e11 s a thread's wait overflows.


def _seconds_keys() -> list[str]:
    def keys(section: dict[str, object], prefix: str = "") -> list[str]:
        found = []
        for name, value in section.items():
            if isinstance(value, dict):
                found += keys(value, f"{prefix}{name}.")
            elif name.endswith("_seconds") or f"{prefix}{name}" == "daemon.interval":
                found.append(f"{prefix}{name}")
        return found

    return keys(stabmon.Config().to_dict())


@pytest.mark.parametrize("key", _seconds_keys())
def test_every_seconds_key_has_an_upper_bound(key: str) -> None:
    section, _, name = key.rpartition(".")
    overrides: dict[str, object] = {section: {name: 1e10}} if section else {key: 1e10}
    with pytest.raises(ConfigError, match=f"^{key} in .*(<= | to )"):
        load_config(overrides, env={})


def test_a_sample_seconds_of_1e10_is_a_one_line_cli_error(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("sample_seconds: 10000000000.0\n")  # YAML 1.1 reads 1e10 as text
    result = subprocess.run([sys.executable, "-c", _CLI, "check-config", str(path)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "sample_seconds" in result.stderr
