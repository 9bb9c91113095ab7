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

import stabmon
from stabmon.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

PIP_INSTALL = (
    "pip install ./stabmon \"torch==$(python -c 'import torch; print(torch.__version__)')\""
)
RUN = "run as written in test_readme_stabmon_commands_run_as_written"
RUN_INLINE = "run as written in test_readme_inline_commands_run_as_written"
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
    '.venv/bin/python -m pytest -m "not slow" -n 3': "its marker expression collects here",
}


# Commands quoted inline in the README's prose (`make bench`, `stabmon env`), and how each
# is checked; a bare subcommand (`stabmon status`) names the command the text is about.
INLINE = re.compile(
    r"`((?:make|stabmon|pip|python|curl|promtool|\. \.venv/bin/activate)(?: [^`]*)?)`"
)
INLINE_CHECKS = {
    "make demo": "make -n (test_readme_inline_make_commands_exist)",
    "make test": "make -n; it runs lint, typecheck and pytest (test_readme_make_test_runs_...)",
    "make TORCH=... demo": "make -n with the default pin for ... (test_readme_inline_make_...)",
    'make PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu" '
    "TORCH=torch==2.13.0+cpu demo": "make -n; both pip commands get PIP_ARGS "
    "(test_readme_pip_args_reach_both_pip_commands)",
    "stabmon report RUN_DIR": "the subcommand exists (test_readme_inline_stabmon_subcommands_...)",
    "make tools": "make -n (test_readme_inline_make_commands_exist)",
    "make dashboards": "make -n (test_readme_inline_make_commands_exist)",
    "make bench": "make -n (test_readme_inline_make_commands_exist)",
    ". .venv/bin/activate": "the venv running the tests has bin/activate and bin/stabmon",
    "stabmon status": "the subcommand exists (test_readme_inline_stabmon_subcommands_exist)",
    "stabmon report": "the subcommand exists (test_readme_inline_stabmon_subcommands_exist)",
    "stabmon compare RUN_A RUN_B": "the subcommand exists (test_readme_inline_stabmon_...)",
    "stabmon daemon": "the subcommand exists (test_readme_inline_stabmon_subcommands_exist)",
    "stabmon env": RUN_INLINE,
    "stabmon check-config stabmon.yaml": RUN_INLINE + ", beside a stabmon.yaml",
    "curl localhost:9400/metrics": "the exporter's default port is 9400 on every address",
    "python bench/series.py": RUN_INLINE,
    "promtool test rules": "tests/deploy/test_rules.py runs it on deploy/prometheus/tests",
}


def readme_inline_commands() -> set[str]:
    """The commands quoted inline in the README's prose (not in code blocks)."""
    prose, inside = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside:
            prose.append(line)
    return {match for match in INLINE.findall("\n".join(prose)) if " " in match}


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


def _make_plan(*args: str) -> str:
    # `make test` runs this suite: a nested make would inherit its flags and print
    # "make[1]: Entering directory" around the plan.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", *args],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_readme_make_test_runs_make_lint_and_make_typecheck_then_pytest() -> None:
    """`make lint` and `make typecheck` are checked by `make test` itself: it runs them."""
    plan = _make_plan("test")
    for part in ("lint", "typecheck"):
        for line in _make_plan(part).splitlines():
            if "pip install" not in line and "-m venv" not in line:  # the shared set-up
                assert line in plan, (part, line)
    assert " -m pytest" in plan.rstrip().splitlines()[-1]  # the tests run last


def test_readme_every_inline_command_has_a_check() -> None:
    assert readme_inline_commands() == set(INLINE_CHECKS)


def test_readme_inline_make_commands_exist() -> None:
    for command in (c for c in INLINE_CHECKS if c.startswith("make ")):
        words = shlex.split(command.replace("TORCH=...", "TORCH=torch==2.13.0"))[1:]
        plan = _make_plan(*words)
        if "demo" in words:
            assert plan.rstrip().endswith("bin/stabmon demo"), plan
    assert "-m venv .venv" in _make_plan("-B", "demo")  # `. .venv/bin/activate` exists after it


def test_readme_pip_args_reach_both_pip_commands() -> None:
    plan = _make_plan("-B", "PIP_ARGS=--extra-index-url https://example.invalid/cpu",
                      ".venv/.installed")  # fmt: skip
    installs = [line for line in plan.splitlines() if "pip install" in line]
    assert len(installs) == 2 and all("https://example.invalid/cpu" in i for i in installs)


def test_readme_the_venv_holds_activate_and_the_stabmon_command() -> None:
    """After `make demo`, `. .venv/bin/activate` puts `stabmon` on the PATH: the venv the
    tests run in (that .venv under `make test`) holds both."""
    bin_dir = Path(sys.prefix) / "bin"
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests do not run in a virtual environment")
    assert (bin_dir / "activate").is_file()
    assert (bin_dir / "stabmon").is_file()


def test_readme_inline_stabmon_subcommands_exist(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (c for c in INLINE_CHECKS if c.startswith("stabmon ")):
        with pytest.raises(SystemExit) as exit_info:
            main([*shlex.split(command)[1:], "--help"])
        assert exit_info.value.code == 0, command
    capsys.readouterr()


def test_readme_curl_reaches_the_exporter_on_its_default_port() -> None:
    config = stabmon.Config()
    assert config.port == 9400 and config.address == "0.0.0.0"  # localhost included


def _stabmon_command() -> list[str]:
    """The `stabmon` console script of this venv, as the README's commands call it."""
    script = Path(sys.prefix) / "bin" / "stabmon"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "stabmon"]


@pytest.mark.slow
def test_readme_inline_commands_run_as_written(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    (tmp_path / "stabmon.yaml").write_text("port: 9400\nstall_seconds: 600\n")
    for command, cwd in (("stabmon env", tmp_path),
                         ("stabmon check-config stabmon.yaml", tmp_path),
                         ("python bench/series.py", ROOT)):  # fmt: skip
        program, *args = shlex.split(command)
        argv = _stabmon_command() if program == "stabmon" else [sys.executable]
        result = subprocess.run([*argv, *args], cwd=cwd, env=env, capture_output=True,
                                text=True, timeout=600)  # fmt: skip
        assert result.returncode == 0, (command, result.stderr[-2000:])
        assert result.stdout.strip(), command


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
    stabmon = _stabmon_command()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    demo_output = tmp_path / "demo.out"
    with demo_output.open("wb") as sink:
        demo = subprocess.Popen(
            [*stabmon, "demo", "--run-dir", "stabmon-runs", "--fast", "--serve", "120",
             "--port", "0"],
            cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        status = ["status", "--run-dir", "stabmon-runs"]
        for _ in range(600):  # "in a second terminal, while it trains": once it has registered
            result = subprocess.run([*stabmon, *status], cwd=tmp_path, env=env,
                                    capture_output=True, text=True, timeout=120)  # fmt: skip
            # 0: every rank healthy; 1: a rank is not (the demo injects a NaN at step 100, so
            # which one depends on how far it got); 2: nothing registered yet.
            if result.returncode in (0, 1) or demo.poll() is not None:
                break
            time.sleep(0.2)
        assert result.returncode in (0, 1), (result.stderr[-2000:], demo_output.read_text()[-2000:])
        header, row = result.stdout.splitlines()[:2]
        assert header.split()[:3] == ["run", "rank", "steps"], result.stdout
        assert row.startswith("demo-") and row.split()[1] == "0", result.stdout
        assert row.endswith("  ok") == (result.returncode == 0), result.stdout
        report = ["report", "stabmon-runs", "-o", "report.html"]
        result = subprocess.run([*stabmon, *report], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        assert (tmp_path / "report.html").stat().st_size > 0
    finally:
        demo.terminate()
        demo.wait(60)


@pytest.mark.slow  # a pytest of its own, importing torch
def test_readme_quick_loop_marker_expression_collects() -> None:
    # The README's marker expression and xdist's -n option, collected in one process:
    # ``-n 0`` parses as ``-n 3`` does without starting three workers that each import torch.
    (line,) = [line for line in README.read_text().splitlines() if "the quick loop" in line]
    assert '-m "not slow" -n 3' in line
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "not slow", "-n", "0", "--collect-only", "-q",
         str(ROOT / "tests" / "test_public_api.py")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:]
    assert "tests collected" in result.stdout


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


def readme_python_blocks() -> list[str]:
    blocks, current = [], None
    for line in README.read_text().splitlines():
        if current is None and line.strip() == "```python":
            current = []
        elif current is not None and line.startswith("```"):
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


@pytest.mark.slow
def test_readme_one_line_loop_runs_as_written(tmp_path: Path) -> None:
    """The first example, copied into a script, trains and writes its event log."""
    (example,) = [block for block in readme_python_blocks() if "# the one line" in block]
    (tmp_path / "train.py").write_text(example)
    env = dict(os.environ, PYTHONPATH=str(ROOT), STABMON_DIR=str(tmp_path / "runs"))
    result = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "metrics at http://" in result.stdout
    (log,) = (tmp_path / "runs").glob("*/rank-0.events.jsonl")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "detach"] == [999]
    assert not [r for r in records if r["event"] == "anomaly"]
