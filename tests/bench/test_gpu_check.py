"""`make gpu-check` says what it needs where it cannot run, and plans every step where it can.

The requirement probes are injected: these tests run the same on a GPU machine.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_check  # noqa: E402 - bench/ is a directory of scripts, not a package


def _no_library(name: str) -> object:
    raise OSError(f"{name}: cannot open shared object file")


CPU_MACHINE = gpu_check.Probes(
    which=lambda name: None,
    run=lambda argv: "",
    load_library=_no_library,
    free_bytes=lambda path: 80 * 10**9,
    has_module=lambda python, module: True,
)


def _gpu_machine(free_gb: float = 80.0) -> gpu_check.Probes:
    def run(argv: Sequence[str]) -> str:
        return "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a1b2c3d)\n"

    return gpu_check.Probes(
        which=lambda name: f"/usr/bin/{name}",
        run=run,
        load_library=lambda name: object(),
        free_bytes=lambda path: int(free_gb * 10**9),
        has_module=lambda python, module: True,
    )


def test_gpu_check_on_a_cpu_machine_lists_what_it_needs_and_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report = tmp_path / "report.md"
    assert gpu_check.main(["--report", str(report)], CPU_MACHINE) == 2
    captured = capsys.readouterr()
    assert "[MISSING] an NVIDIA GPU, listed by `nvidia-smi -L`: no nvidia-smi on PATH" in (
        captured.out
    )
    assert "[MISSING] the NVIDIA driver's NVML library" in captured.out
    assert "to get it: install the NVIDIA driver" in captured.out
    assert "cannot run here: 2 requirement(s) missing" in captured.err
    assert "nothing was changed" in captured.err
    assert not report.exists()  # nothing run, nothing written


def test_gpu_check_dry_run_on_a_gpu_machine_plans_every_step_and_runs_none(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    argv = ["--dry-run", "--venv", str(venv), "--index-url", "https://example.invalid/cu128"]
    assert gpu_check.main(argv, _gpu_machine()) == 0
    out = capsys.readouterr().out
    assert "[ok] an NVIDIA GPU, listed by `nvidia-smi -L`: GPU 0: NVIDIA H100" in out
    for expected in ("-m venv", "torch==2.13.0 --index-url https://example.invalid/cu128",
                     "-m gpu tests", "tests/test_sync_audit.py", "--device cuda",
                     "tests/integration/test_daemon_real_nvml.py"):  # fmt: skip
        assert expected in out, expected
    assert not venv.exists()


def test_gpu_check_refuses_a_disk_too_small_for_a_cuda_torch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert gpu_check.main(["--dry-run"], _gpu_machine(free_gb=3.0)) == 2
    assert "[MISSING] 10 GB free for the venv's CUDA torch: 3.0 GB free" in capsys.readouterr().out


def test_gpu_check_with_an_existing_cuda_python_makes_no_venv(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        gpu_check.main(["--dry-run", "--python", "/opt/cuda-env/bin/python"], _gpu_machine()) == 0
    )
    out = capsys.readouterr().out
    assert "-m venv" not in out and "pip install" not in out
    assert "/opt/cuda-env/bin/python -m pytest -p no:cacheprovider -rA -q -m gpu tests" in out


def test_gpu_check_counts_a_skipped_gpu_test_as_a_failure(tmp_path: Path) -> None:
    script = tmp_path / "skips.py"
    script.write_text("print('SKIPPED [1] tests/test_gpu.py:10: Requires: CUDA')\n")
    step = gpu_check.Step("every gpu-marked test", [sys.executable, str(script), "-m", "gpu"])
    gpu_check.run_step(step)
    assert step.returncode == 1 and "skipped on a GPU machine" in step.output
    report = tmp_path / "report.md"
    text = gpu_check.report(report, [], [step], "GPU 0: test")
    assert "**FAILED**" in text and report.read_text() == text
