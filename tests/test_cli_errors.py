"""CLI errors are one line on stderr, name the real source (a flag, a folder), and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from stabmon.cli import main


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("stabmon: error: ")
    return err[0]


def test_cli_report_into_a_missing_folder_is_one_line_naming_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "runs").mkdir()
    output = tmp_path / "missing-dir" / "x.html"
    assert main(["report", str(tmp_path / "runs"), "-o", str(output)]) == 2
    line = _one_line_error(capsys)
    assert f"the folder {output.parent} does not exist" in line
    assert "Traceback" not in line


def test_cli_daemon_interval_zero_names_the_flag_not_attach(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["daemon", "--interval", "0"]) == 2
    line = _one_line_error(capsys)
    assert "--interval in the command line: expected a number > 0, got 0" in line
    assert "attach()" not in line


def test_cli_daemon_address_that_does_not_resolve_is_named_as_the_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["daemon", "--address", "999.1.1.1", "--port", "0", "--run-dir", str(tmp_path)]
    assert main(argv) == 2
    line = _one_line_error(capsys)
    assert "--address 999.1.1.1 is not an address this machine can bind" in line
    assert "free --port" not in line
