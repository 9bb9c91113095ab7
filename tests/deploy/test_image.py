"""deploy/docker/Dockerfile: a pinned, non-root image of the daemon alone, that runs without torch.

No Docker engine runs here, so the Dockerfile is parsed and held to what the rest of the
repository says (pyproject's dependency ranges, the daemon's default port, the uid the
DaemonSet runs as), and the daemon is started the way the image holds it: torch and numpy
absent.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

from deploy_helpers import ROOT, dockerfile_instructions, dockerfile_user

from stabmon.config import load_config

DOCKERIGNORE = ROOT / ".dockerignore"
#: What `stabmon daemon` imports; the image installs these and stabmon with --no-deps.
DAEMON_DEPENDENCIES = ("prometheus-client", "nvidia-ml-py", "psutil", "pyyaml")
#: A slim Debian bookworm Python with its full patch version (a moving 3.11 tag drifts).
PINNED_BASE = r"python:3\.\d+\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?"
UID = 65532


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instruction in dockerfile_instructions():
        if instruction[0] == "FROM":
            stages.append([])
        stages[-1].append(instruction)
    return stages


def _final(instruction: str) -> list[str]:
    return [args for name, args in _stages()[-1] if name == instruction]


def _requirement(text: str) -> tuple[str, frozenset[str]]:
    """A requirement's name and its version clauses, in whatever order they were written."""
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*([^;]*)", text.strip())
    assert match, f"unexpected requirement {text!r}"
    clauses = frozenset(clause.strip() for clause in match[2].split(",") if clause.strip())
    return match[1].lower(), clauses


def _runtime_requirements() -> set[tuple[str, frozenset[str]]]:
    """stabmon's own dependencies (no extras), as the installed metadata declares them.

    The installed metadata is pyproject.toml's (`make` reinstalls whenever it changes), read
    this way because tomllib is not in Python 3.10.
    """
    declared = importlib.metadata.requires("stabmon") or []
    return {_requirement(text) for text in declared if "extra ==" not in text}


def test_dockerfile_every_stage_is_a_pinned_slim_python() -> None:
    bases = [args.split()[0] for name, args in dockerfile_instructions() if name == "FROM"]
    assert bases
    for base in bases:
        assert re.fullmatch(PINNED_BASE, base), f"FROM {base} is not pinned"
    assert len(set(bases)) == 1, "build and run stages must share one Python"


def test_dockerfile_runs_as_a_fixed_numeric_non_root_user() -> None:
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    assert dockerfile_user() == f"{UID}:{UID}"
    (create,) = [args for args in _final("RUN") if "useradd" in args]
    assert f"--uid {UID}" in create and f"--gid {UID}" in create


def test_dockerfile_installs_the_daemon_dependencies_with_pyprojects_ranges() -> None:
    (install,) = [
        args for args in _final("RUN") if "pip install" in args and "--no-deps" not in args
    ]
    named = {_requirement(text) for text in re.findall(r'"([^"]+)"', install)}
    declared = {req for req in _runtime_requirements() if req[0] in DAEMON_DEPENDENCIES}
    assert {name for name, _ in declared} == set(DAEMON_DEPENDENCIES)
    assert named == declared


def test_dockerfile_installs_stabmon_without_its_dependencies() -> None:
    (install,) = [args for args in _final("RUN") if "--no-deps" in args]
    assert re.search(r"pip install --no-deps /wheels/\S*\.whl", install)
    (build,) = [args for name, args in _stages()[0] if name == "RUN"]
    assert "--no-deps" in build  # the wheel stage must not fetch torch either


def test_dockerfile_never_installs_torch_or_numpy() -> None:
    for name, args in dockerfile_instructions():
        assert not re.search(r"\b(torch|numpy)\b", args, flags=re.IGNORECASE), f"{name} {args}"


def test_dockerfile_entrypoint_is_the_daemon_command() -> None:
    (entrypoint,) = _final("ENTRYPOINT")
    assert json.loads(entrypoint) == ["stabmon", "daemon"]
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="stabmon")
    assert script.value == "stabmon.cli:main"


def test_dockerfile_exposes_the_daemons_default_port() -> None:
    (exposed,) = _final("EXPOSE")
    assert exposed == str(load_config({}, env={}).daemon.port)


def test_dockerignore_admits_only_what_the_dockerfile_copies() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert patterns[0] == "*"  # an allowlist: .venv, .git and caches never reach the daemon
    admitted = {pattern[1:] for pattern in patterns if pattern.startswith("!")}
    copied = {
        source
        for name, args in dockerfile_instructions()
        if name == "COPY" and not args.startswith("--from")
        for source in args.split()[:-1]
    }
    assert admitted == copied
    for source in copied:
        assert (ROOT / source).exists(), source
    assert not admitted & {".venv", ".git", "tests"}


def test_daemon_runs_and_serves_with_torch_and_numpy_absent(tmp_path: Path) -> None:
    script = Path(__file__).with_name("daemon_without_torch.py")
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    observed = json.loads(result.stdout.splitlines()[-1])
    assert "usage: stabmon daemon" in observed["help"]
    assert observed["started"] is True
    assert observed["nvml_up_exported"] is True
    assert observed["process_up"] == [1.0]
    # /targets names the rank on the host the request addressed, for Prometheus to scrape.
    (group,) = observed["targets"]
    assert group["targets"] == [f"node-7:{observed['port']}"]
    assert group["labels"]["__meta_stabmon_run"] == "image"
    assert observed["loaded"] == []
