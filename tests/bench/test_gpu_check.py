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
    has_cuda_torch=lambda python: False,
)


def _gpu_machine(
    free_gb: float = 80.0, *, cuda_python: bool = False, lacks: Sequence[str] = ()
) -> gpu_check.Probes:
    """A GPU machine; ``cuda_python``: its interpreter has a CUDA torch; ``lacks``: modules
    that interpreter does not have."""

    def run(argv: Sequence[str]) -> str:
        return "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a1b2c3d)\n"

    return gpu_check.Probes(
        which=lambda name: f"/usr/bin/{name}",
        run=run,
        load_library=lambda name: object(),
        free_bytes=lambda path: int(free_gb * 10**9),
        has_module=lambda python, module: module not in lacks,
        has_cuda_torch=lambda python: cuda_python,
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
                     "-m gpu tests/test_gpu.py", "tests/test_sync_audit.py",
                     "bench/gpu_gpt.py --compile no",
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
        gpu_check.main(
            ["--dry-run", "--python", "/opt/cuda-env/bin/python"], _gpu_machine(cuda_python=True)
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "-m venv" not in out and "pip install" not in out
    assert "/opt/cuda-env/bin/python -m pytest -p no:cacheprovider -o addopts= -rA -q" in out


def test_gpu_check_counts_a_skipped_gpu_test_as_a_failure(tmp_path: Path) -> None:
    script = tmp_path / "skips.py"
    script.write_text("print('SKIPPED [1] tests/test_gpu.py:10: Requires: CUDA')\n")
    step = gpu_check.Step("every gpu-marked test", [sys.executable, str(script), "-m", "gpu"])
    gpu_check.run_step(step)
    assert step.returncode == 1 and "skipped on a GPU machine" in step.output
    report = tmp_path / "report.md"
    text = gpu_check.report(report, [], [step], "GPU 0: test")
    assert "**FAILED**" in text and report.read_text() == text
    # The whole output lies beside the report: a failure's cause is often above the tail.
    assert (tmp_path / "report-step1.log").read_text() == step.output


def _plan(argv: list[str], probes: gpu_check.Probes) -> list[gpu_check.Step]:
    args = gpu_check.parse_args(argv)
    return gpu_check.plan(args, Path("."), gpu_check.interpreter(args, probes))[1]


def test_gpu_check_uses_an_interpreter_that_has_a_cuda_torch_and_installs_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--dry-run", "--base-python", "/usr/bin/python3"]
    assert gpu_check.main(argv, _gpu_machine(cuda_python=True)) == 0
    out = capsys.readouterr().out
    assert "-m venv" not in out and "pip install" not in out and "GB free" not in out
    assert f"PYTHONPATH={gpu_check.ROOT} /usr/bin/python3 -m pytest" in out  # this checkout
    assert "-m gpu tests/test_gpu.py" in out and "-m gpu tests\n" not in out  # never all of tests


def test_gpu_check_install_makes_the_venv_even_when_the_interpreter_has_a_cuda_torch() -> None:
    steps = _plan(["--install"], _gpu_machine(cuda_python=True))
    assert [step.name for step in steps][:3] == [
        "create the venv", "install a CUDA torch", "install stabmon"
    ]  # fmt: skip


def test_gpu_check_names_the_modules_a_cuda_interpreter_lacks_and_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    probes = _gpu_machine(cuda_python=True, lacks=("pytest", "pynvml"))
    assert gpu_check.main(["--dry-run", "--base-python", "/usr/bin/python3"], probes) == 2
    out = capsys.readouterr().out
    assert "missing: pytest, pynvml" in out
    assert "/usr/bin/python3 -m pip install pytest nvidia-ml-py" in out


def test_gpu_check_budgets_its_steps_under_five_minutes_after_any_install() -> None:
    for cuda_python in (True, False):
        steps = _plan([], _gpu_machine(cuda_python=cuda_python))
        budgeted = [step.timeout for step in steps if step.budgeted]
        assert sum(budgeted) <= gpu_check.BUDGET_SECONDS < 300


def test_gpu_check_collects_the_gpu_tests_of_every_file_that_has_some() -> None:
    tests = Path(gpu_check.ROOT) / "tests"
    marked = {
        str(path.relative_to(gpu_check.ROOT))
        for path in tests.rglob("test_*.py")
        if "pytest.mark" + ".gpu" in path.read_text()  # split: this file is not one of them
    }
    # The overhead benchmark's test measures what step 4 (bench/gpu_gpt.py) measures.
    assert set(gpu_check.GPU_TEST_FILES) == marked - {"tests/bench/test_gpu_overhead.py"}


def test_gpu_check_stops_a_step_that_outruns_its_bound_and_reports_it(tmp_path: Path) -> None:
    script = tmp_path / "hangs.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    step = gpu_check.Step("hangs", [sys.executable, str(script)], timeout=600)

    gpu_check.run_step(step, seconds=1.0)  # the budget left is what bounds it

    assert step.returncode == 124
    assert "started" in step.output and "stopped after 1 s" in step.output


def test_gpu_check_runs_no_budgeted_step_once_the_budget_is_spent(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    steps = [gpu_check.Step(name, [sys.executable, str(script)]) for name in ("first", "second")]

    gpu_check.run_steps(steps, budget=0.5)

    assert [step.returncode for step in steps] == [None, None]
