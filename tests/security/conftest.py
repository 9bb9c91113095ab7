"""A second local user for the shared-node tests: ``nobody``, through ``setpriv``.

The tests of issue 21 act as a hostile neighbour on the same node. As root,
``hostile.run(code)`` runs Python as uid/gid 65534 with no supplementary
groups; otherwise the tests that need it skip with a reason. ``shared`` is a
fresh world-writable, sticky directory under /tmp (like /var/tmp/stabmon),
reachable by both users (pytest's own tmp_path is private to root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

NOBODY = 65534


class Hostile:
    """Runs code as the other user of the node."""

    uid = NOBODY

    def run(self, code: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                   sys.executable, "-c", code, *args]  # fmt: skip
        environment = {
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        }
        result = subprocess.run(
            command, capture_output=True, text=True, env=environment, timeout=60
        )
        if check and result.returncode != 0:
            raise AssertionError(f"as nobody: {result.stderr}")
        return result

    def start(self, code: str, *args: str) -> subprocess.Popen[str]:
        command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                   sys.executable, "-c", code, *args]  # fmt: skip
        environment = {
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        }
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment)


@pytest.fixture
def hostile() -> Hostile:
    if os.geteuid() != 0:
        pytest.skip("Requires: root, to act as a second local user (nobody) with setpriv")
    if shutil.which("setpriv") is None:
        pytest.skip("Requires: setpriv (util-linux), to act as a second local user")
    return Hostile()


@pytest.fixture
def shared() -> Iterator[Path]:
    """A /tmp-like directory every user may write (mode 1777), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="stabmon-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)
