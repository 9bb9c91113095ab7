"""NVML constants read from whatever nvidia-ml-py a node has, nvml.h's value where it has none."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from stabmon.contract import THROTTLE_REASONS
from stabmon.hardware import nvml
from stabmon.hardware.nvml_constants import NvmlConstants, constants_of, nvml_constant


def test_nvml_constant_falls_back_to_the_header_value_when_the_module_lacks_the_name() -> None:
    release = SimpleNamespace(NVML_TEMPERATURE_GPU=0)  # a release without NVML_TEMPERATURE_GPU_MAX

    assert nvml_constant(release, "NVML_TEMPERATURE_GPU_MAX", default=1) == 1
    assert nvml_constant(release, "NVML_TEMPERATURE_GPU", default=7) == 0


def test_nvml_constant_ignores_a_name_that_is_not_an_int() -> None:
    release = SimpleNamespace(NVML_CLOCK_SM="1", NVML_AGGREGATE_ECC=True)

    assert nvml_constant(release, "NVML_CLOCK_SM", default=1) == 1
    assert nvml_constant(release, "NVML_AGGREGATE_ECC", default=1) == 1


def test_constants_of_an_empty_module_are_nvml_h_values() -> None:
    constants = constants_of(SimpleNamespace())

    assert constants.error_gpu_is_lost == 15 and constants.error_not_supported == 3
    assert dict(constants.reasons)["hw_thermal_slowdown"] == 0x40
    assert {name for name, _ in constants.reasons} == set(THROTTLE_REASONS)


def test_constants_of_an_old_release_read_the_clock_throttle_reason_names() -> None:
    old = SimpleNamespace(nvmlClocksThrottleReasonSwPowerCap=0x4000)  # a made-up value: read

    assert dict(constants_of(old).reasons)["sw_power_cap"] == 0x4000


def test_constants_of_the_installed_pynvml_match_the_header_values() -> None:
    installed, header = constants_of(pynvml), constants_of(SimpleNamespace())

    assert installed == header
    assert installed != NvmlConstants()  # the reason bits are filled in


def test_the_nvml_seam_imports_against_a_pynvml_release_lacking_the_constants(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bare = types.ModuleType("pynvml")  # a release with none of the constants the daemon reads
    monkeypatch.setitem(sys.modules, "pynvml", bare)
    path = Path(nvml.__file__)
    spec = importlib.util.spec_from_file_location("nvml_under_a_bare_release", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)

    assert module.THROTTLE_REASON_BITS["sw_power_cap"] == 0x4
    assert module.NvmlError("nvmlDeviceGetPowerUsage", "gone", code=15).gpu_lost
