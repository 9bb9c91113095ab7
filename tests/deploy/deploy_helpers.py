"""What the deployment tests share: repository paths, YAML loading, and the external tools.

promtool and amtool come from Debian's prometheus and prometheus-alertmanager packages
(`make tools`). A test that needs one skips without it on a developer machine and fails in CI,
where a silently skipped check would hide a broken config (as tests/deploy/test_rules.py does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES_FILE = DEPLOY / "prometheus" / "rules" / "stabmon.rules.yml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"


def required_tool(name: str, package: str) -> str:
    """The path of ``name``: skipped without it locally, a failure in CI."""
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed; CI must run this check (make tools)")
        pytest.skip(f"Requires: {name} (apt-get install {package})")
    return found


def run_tool(*command: str | Path) -> subprocess.CompletedProcess[str]:
    """Run an external checker; the caller asserts on its exit code and output."""
    return subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, check=False, timeout=60
    )


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty document of a multi-document YAML file."""
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """The Dockerfile's (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def dockerfile_user() -> str:
    """The USER the image's daemon runs as (the last USER instruction)."""
    return [args for name, args in dockerfile_instructions() if name == "USER"][-1]
