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
    assert "--interval in the command line: expected a number > 0 and <= 2592000, got 0" in line
    assert "attach()" not in line


def test_cli_daemon_address_that_does_not_resolve_is_named_as_the_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["daemon", "--address", "999.1.1.1", "--port", "0", "--run-dir", str(tmp_path)]
    assert main(argv) == 2
    line = _one_line_error(capsys)
    assert "--address 999.1.1.1 is not an address this machine can bind" in line
    assert "free --port" not in line


def _bad_invocations(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(argv, what its one-line error must say) for every subcommand's bad inputs."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("port: [\n")
    bad_value = tmp_path / "port.yaml"
    bad_value.write_text("port: -5\n")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "rank-0.events.jsonl").write_text('{"event": "attach", "run": "r", "rank": 0}\n')
    return [
        (["demo", "--port", "-1"], "--port in the command line: expected an integer from 0"),
        (["demo", "--port", "70000"], "--port in the command line"),
        (["demo", "--serve", "-5"], "--serve must be a number of seconds >= 0, got -5.0"),
        (["demo", "--serve", "nan"], "--serve must be a number of seconds >= 0, got nan"),
        (["demo", "--run-dir", str(a_file)], f"--run-dir {a_file} is not a directory"),
        (
            ["daemon", "--run-dir", str(a_file), "--port", "0"],
            f"--run-dir {a_file} is not a directory",
        ),
        (["daemon", "--port", "-1"], "--port in the command line"),
        (["daemon", "--interval", "nan"], "--interval in the command line"),
        (["daemon", "--address", ""], "--address in the command line"),
        (["daemon", "--config", str(tmp_path / "none.yaml")], "none.yaml: config file not found"),
        (["daemon", "--config", str(bad_yaml)], "bad.yaml: malformed YAML at line"),
        (["daemon", "--config", str(bad_value)], "port in "),
        (["check-config", str(tmp_path)], "cannot read config file (Is a directory)"),
        (["check-config", str(bad_value)], "expected an integer from 0 to 65535, got -5"),
        (["report", str(tmp_path / "none")], "is neither a run directory nor an event log"),
        (["report", str(runs), "-o", str(tmp_path)], f"cannot write the report to {tmp_path}"),
        (
            ["report", str(runs), "--module-rank", "3", "-o", str(tmp_path / "r.html")],
            "module rank 3: run r has no rank 3 (its ranks: 0)",
        ),
        (["status", "--run-dir", str(a_file)], f"--run-dir {a_file} is not a directory"),
        (["status", "--run-dir", str(tmp_path / "none")], "(it does not exist)"),
        (["status", "--timeout", "0", "http://127.0.0.1:1/"], "--timeout must be a number"),
        (["status", "--cafile", str(a_file), "http://127.0.0.1:1/"], f"--cafile {a_file}: not"),
        (
            ["status", "--basic-auth-file", str(tmp_path / "none"), "http://127.0.0.1:1/"],
            "--basic-auth-file: ",
        ),
    ]


def test_cli_every_bad_argument_is_one_line_naming_its_source_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, expected in _bad_invocations(tmp_path):
        assert main(argv) == 2, argv
        line = _one_line_error(capsys)
        assert expected in line, (argv, line)
        assert "attach()" not in line, (argv, line)  # the flag, not the library's keyword
    assert not (tmp_path / "r.html").exists()


def test_cli_usage_errors_are_one_line_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["bogus"], ["report"], ["daemon", "--port", "abc"], ["env", "--bogus"],
                 ["status", "--timeout", "abc"]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
        line = _one_line_error(capsys)
        assert line.endswith("(see `stabmon --help`)"), line
