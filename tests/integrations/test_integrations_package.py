"""The integrations package costs nothing until an adapter is imported."""

from __future__ import annotations

import subprocess
import sys


def test_integrations_import_of_stabmon_and_the_package_imports_no_framework() -> None:
    code = ("import sys, stabmon, stabmon.integrations; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'transformers', 'ultralytics')))")  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
