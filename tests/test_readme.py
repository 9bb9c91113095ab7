"""Every shell command in README.md is checked: run as written, or parsed by the real parser.

``CHECKS`` names, for each command, how it is checked; a command added to the README
without an entry fails ``test_readme_every_shell_command_has_a_check``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stabmon.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

PIP_INSTALL = (
    "pip install ./stabmon \"torch==$(python -c 'import torch; print(torch.__version__)')\""
)
RUN = "run as written in test_readme_stabmon_commands_run_as_written"
DAEMON = (
    "stabmon daemon [--config FILE] [--port 9399] [--address 0.0.0.0]"
    " [--run-dir /var/tmp/stabmon] [--interval 5]"
)
CHECKS = {
    PIP_INSTALL: "test_readme_pip_install_from_the_clone_keeps_the_installed_torch (dry run)",
    "make demo": "make -n here; run for real from a fresh clone (issue 23's note)",
    "make test": "make -n here; CI runs it (.ci/run)",
    "make lint": "make -n here; part of make test",
    "make typecheck": "make -n here; part of make test",
    "stabmon demo --run-dir stabmon-runs": RUN + ", with --fast --serve and --port 0 added",
    "stabmon status --run-dir stabmon-runs": RUN,
    "stabmon report stabmon-runs -o report.html": RUN,
    DAEMON: "a synopsis: every option parsed by the real parser",
    '.venv/bin/python -m pytest -m "not slow"': "its marker expression collects here",
}


def readme_commands() -> list[str]:
    """The command lines of README.md's ``sh`` blocks, without their trailing comments."""
    commands, inside = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside and line.strip() in {"```sh", "```bash"}
            continue
        if inside and line.strip():
            commands.append(re.sub(r"\s+#\s.*$", "", line).strip())
    return commands


def test_readme_every_shell_command_has_a_check() -> None:
    assert set(readme_commands()) == set(CHECKS)


@pytest.mark.parametrize("target", ["demo", "test", "lint", "typecheck"])
def test_readme_make_targets_exist(target: str) -> None:
    result = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_readme_stabmon_commands_parse_with_the_real_parser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in (c for c in CHECKS if c.startswith("stabmon ")):
        words = [w.strip("[]") for w in shlex.split(command)[1:]]
        words = [w for w in words if w != "FILE"] if "[--config" in command else words
        if "[--config" in command:  # the synopsis: one option at a time, with its example value
            options = re.findall(r"\[(--[\w-]+)(?: (\S+?))?\]", command)
            for option, example in options:
                argv = ["daemon", option, example if example != "FILE" else "x.yaml", "--help"]
                with pytest.raises(SystemExit) as exit_info:
                    main(argv)
                assert exit_info.value.code == 0, argv
            continue
        with pytest.raises(SystemExit) as exit_info:
            main([*words, "--help"])
        assert exit_info.value.code == 0, command
    capsys.readouterr()


@pytest.mark.slow
def test_readme_stabmon_commands_run_as_written(tmp_path: Path) -> None:
    stabmon = [sys.executable, "-m", "stabmon.cli"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    demo = subprocess.Popen(
        [*stabmon, "demo", "--run-dir", "stabmon-runs", "--fast", "--serve", "120", "--port", "0"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        status = ["status", "--run-dir", "stabmon-runs"]
        for _ in range(600):  # "in a second terminal, while it trains": once it has registered
            result = subprocess.run([*stabmon, *status], cwd=tmp_path, env=env,
                                    capture_output=True, text=True, timeout=120)  # fmt: skip
            if result.returncode == 0 or demo.poll() is not None:
                break
            time.sleep(0.2)
        assert result.returncode == 0, result.stderr[-2000:]
        report = ["report", "stabmon-runs", "-o", "report.html"]
        result = subprocess.run([*stabmon, *report], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        assert (tmp_path / "report.html").stat().st_size > 0
    finally:
        demo.terminate()
        demo.wait(60)


def test_readme_quick_loop_marker_expression_collects() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "not slow", "--collect-only", "-q",
         str(ROOT / "tests" / "test_public_api.py")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:]


@pytest.mark.slow
def test_readme_pip_install_from_the_clone_keeps_the_installed_torch(tmp_path: Path) -> None:
    """The README's install line, resolved by pip (``--dry-run``) from a directory named stabmon."""
    (tmp_path / "stabmon").symlink_to(ROOT)
    command = PIP_INSTALL.replace(
        "pip install", "pip install --dry-run --quiet --report report.json"
    )
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    command = command.replace("pip ", f"{sys.executable} -m pip ", 1)
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    installs = {item["metadata"]["name"].lower() for item in report["install"]}
    assert "stabmon" in installs
    assert "torch" not in installs, f"pip would replace torch {torch.__version__}"
