"""The report as a person sees it: opened in headless Chromium, every section there, no error.

Chromium is Debian's ``chromium`` package (``make tools``). Without it the test
is skipped on a developer machine and fails in CI, as the promtool checks do.
The screenshot is kept in ``test-artifacts/report.png`` to look at.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from report_helpers import FaultyRun, stabmon_cli

from stabmon.report.html import SECTION_IDS

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0",
)  # fmt: skip


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("CI"):
        pytest.fail("chromium is not installed; CI must run this check (make tools)")
    pytest.skip("Requires: chromium (apt-get install chromium)")


def _browse(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [chromium, *_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.slow
def test_report_opens_in_headless_chromium_with_every_section_and_no_console_error(
    faulty_run: FaultyRun, tmp_path: Path
) -> None:
    chromium = _chromium()
    report = tmp_path / "report.html"
    assert stabmon_cli("report", str(faulty_run.directory), "-o", str(report)).returncode == 0
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "report.png"
    screenshot.unlink(missing_ok=True)

    dom = _browse(chromium, tmp_path / "profile-dom", "--dump-dom", report.as_uri())
    shot = _browse(
        chromium, tmp_path / "profile-shot", f"--screenshot={screenshot}",
        "--window-size=1280,4000", report.as_uri(),
    )  # fmt: skip

    assert dom.returncode == 0, dom.stderr[-2000:]
    for section in SECTION_IDS:
        assert f'id="{section}"' in dom.stdout, section
    assert dom.stdout.count("<svg") >= 4
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == []
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert screenshot.stat().st_size > 50_000  # a rendered page, not a blank one
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
