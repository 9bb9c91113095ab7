"""stabmon.hardware.gpu_readings: SI units from NVML's, and readings that import no pynvml
(the daemon's collectors and tests/daemon/fake_nvml.py type against them)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from stabmon.hardware.gpu_readings import GpuProcess, mhz_to_hertz, mw_to_watts, to_ratio


def test_units_are_si_ratios_watts_and_hertz() -> None:
    assert to_ratio(85) == pytest.approx(0.85)
    assert mw_to_watts(250_000) == 250.0
    assert mhz_to_hertz(1_980) == 1.98e9


def test_a_reading_is_frozen() -> None:
    process = GpuProcess(pid=7, used_bytes=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        process.pid = 8  # type: ignore[misc]


def test_importing_the_readings_loads_no_pynvml() -> None:
    code = "import sys, stabmon.hardware.gpu_readings; print('pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
