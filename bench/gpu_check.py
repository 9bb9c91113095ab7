"""`make gpu-check`: everything stabmon claims about CUDA, run on a real GPU, in one report file.

Made for a borrowed GPU machine (minutes of device time, no network): by default it uses the
interpreter it runs under when that has a CUDA build of torch (``--python`` names another),
installs nothing, and runs stabmon from this checkout (``PYTHONPATH``). ``--install`` (or an
interpreter without a CUDA torch) takes the workstation path instead: a venv (``.venv-gpu``)
with a CUDA torch from PyTorch's wheel index (or ``--find-links``) and stabmon's dev extras.
Then, each step bounded by its own timeout and all of them by ``--budget-seconds`` (default
290: the check ends within five minutes, leaving the device time to run it again):

1. torch sees the GPU;
2. the ``gpu``-marked tests of :data:`GPU_TEST_FILES` (``pytest -m gpu`` on those files, not
   on ``tests``: the other modules import packages such a machine need not have); a gpu test
   that skips there fails the check;
3. the sync audit on fake CUDA (``tests/test_sync_audit.py -m "not gpu"``; its real-device
   half ran in step 2);
4. a GPT loop on the GPU (``bench/gpu_gpt.py --compile no``): the FLOPs and MFU stabmon exports
   for nanoGPT's GPT-2-small against the PaLM formula and ``FlopCounterMode``, and stabmon's
   cost per step on it and on a launch-bound small GPT, every attached block under sync-debug
   "error" (``--compile only`` measures the compiled loops: run it apart, its compiles do not
   fit the budget);

and writes one Markdown report (``gpu-check-report.md``): the machine, each step's command,
exit status, time and the end of its output (the whole output beside it, in
``gpu-check-report-stepN.log``). A step that runs out of time is stopped (its process group
killed) and reported with exit 124. It exits 0 when every step passed, 1 otherwise.

Where something it needs is missing (no GPU, no driver, a module the interpreter lacks, no
venv module or too little disk for an install) it says what, and how to get it, and exits 2
before changing anything. ``--dry-run`` checks the same and prints the plan without running
it. Standard library only: it runs under any Python, which need not have torch.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The torch build the project pins (Makefile's TORCH), from PyTorch's CUDA 12.8 wheel index.
DEFAULT_TORCH = "torch==2.13.0"
DEFAULT_INDEX_URL = "https://download.pytorch.org/whl/cu128"
#: A CUDA torch with its NVIDIA libraries takes about 6 GB installed; pip needs room to unpack.
MIN_FREE_GB = 10.0
OUTPUT_LINES = 80
#: Every test file that holds ``gpu``-marked tests, but the overhead benchmark's (step 4
#: measures the same, sync-checked, on nanoGPT's shape). tests/bench/test_gpu_check.py keeps
#: it complete.
GPU_TEST_FILES = (
    "tests/test_gpu.py",
    "tests/test_sync_audit.py",
    "tests/pipeline/test_readback.py",
    "tests/probes/test_device_timing.py",
    "tests/hardware/test_devices.py",
    "tests/hardware/test_nvml.py",
    "tests/integration/test_daemon_real_nvml.py",
    "tests/probes/test_fingerprint.py",
    "tests/probes/test_replicas.py",
    "tests/policies/test_plugin.py",
)
#: Modules those tests and stabmon import, checked in an interpreter used as it is.
TEST_MODULES = ("pytest", "numpy", "prometheus_client", "psutil", "yaml", "pynvml")
#: The whole check's default bound, and the per-step bounds inside it (seconds).
BUDGET_SECONDS = 290.0
INSTALL_SECONDS = 1200.0
CUDA_TORCH = "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"


@dataclass(frozen=True)
class Need:
    """One requirement: whether it is met, what was found, and how to meet it."""

    what: str
    met: bool
    found: str
    remedy: str = ""


@dataclass(frozen=True)
class Probes:
    """How the requirements are looked up (injected by the tests)."""

    which: Callable[[str], str | None] = shutil.which
    run: Callable[[Sequence[str]], str] = lambda argv: (
        subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=True).stdout
    )
    load_library: Callable[[str], object] = ctypes.CDLL
    free_bytes: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free
    has_module: Callable[[str, str], bool] = lambda python, module: (
        subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0
    )
    has_cuda_torch: Callable[[str], bool] = lambda python: (
        subprocess.run([python, "-c", CUDA_TORCH], capture_output=True, timeout=120).returncode == 0
    )


def interpreter(args: argparse.Namespace, probes: Probes) -> str | None:
    """The interpreter to use as it is (no install), or None for the install path."""
    if args.python:
        return str(args.python)
    if not args.install and probes.has_cuda_torch(args.base_python):
        return str(args.base_python)
    return None


def needs(args: argparse.Namespace, probes: Probes) -> list[Need]:
    """Every requirement of the check, each with what was found."""
    found = _device_needs(probes)
    python = interpreter(args, probes)
    if python is not None:
        return found + _interpreter_needs(python, probes, named=bool(args.python))
    return found + _install_needs(args, probes)


def _device_needs(probes: Probes) -> list[Need]:
    smi = probes.which("nvidia-smi")
    gpus: list[str] = []
    if smi is not None:
        try:
            gpus = [line for line in probes.run([smi, "-L"]).splitlines() if line.startswith("GPU")]
        except (OSError, subprocess.SubprocessError) as error:
            gpus, smi = [], f"{smi} (fails: {error})"
    try:
        probes.load_library("libnvidia-ml.so.1")
        nvml, where = True, "libnvidia-ml.so.1 loads"
    except OSError as error:
        nvml, where = False, f"libnvidia-ml.so.1 does not load ({error})"
    return [
        Need("an NVIDIA GPU, listed by `nvidia-smi -L`", bool(gpus),
             "; ".join(gpus) if gpus else (smi or "no nvidia-smi on PATH"),
             "run on a machine with an NVIDIA GPU and its driver installed"),
        Need("the NVIDIA driver's NVML library", nvml, where,
             "install the NVIDIA driver (it ships libnvidia-ml.so.1)"),
    ]  # fmt: skip


def _interpreter_needs(python: str, probes: Probes, *, named: bool) -> list[Need]:
    """An interpreter used as it is: a CUDA torch and the test modules, nothing installed."""
    cuda = probes.has_cuda_torch(python) if named else True  # unnamed: found by that probe
    missing = [module for module in TEST_MODULES if not probes.has_module(python, module)]
    packages = {"yaml": "pyyaml", "pynvml": "nvidia-ml-py", "prometheus_client":
                "prometheus-client"}  # fmt: skip
    wanted = " ".join(packages.get(module, module) for module in missing)
    return [
        Need(f"a CUDA build of torch in {python} (used as it is, nothing installed)", cuda,
             "torch with CUDA imports" if cuda else "no CUDA torch imports",
             "install a CUDA torch there, or run with --install (needs network)"),
        Need(f"{', '.join(TEST_MODULES)} in {python}", not missing,
             "all import" if not missing else f"missing: {', '.join(missing)}",
             f"{python} -m pip install {wanted} (or --find-links a wheelhouse), or --install"),
    ]  # fmt: skip


def _install_needs(args: argparse.Namespace, probes: Probes) -> list[Need]:
    """The workstation path: a venv with a CUDA torch from an index or a wheelhouse."""
    venv_ok = probes.has_module(args.base_python, "venv") and probes.has_module(
        args.base_python, "ensurepip"
    )
    target = Path(args.venv).resolve().parent
    free = probes.free_bytes(target) / 1e9
    source = f"--find-links {args.find_links}" if args.find_links else args.index_url
    return [
        Need(f"{args.base_python} with the venv and ensurepip modules (Python >= 3.10)", venv_ok,
             "present" if venv_ok else "missing",
             "install python3-venv (Debian/Ubuntu: apt-get install python3-venv)"),
        Need(f"{MIN_FREE_GB:.0f} GB free for the venv's CUDA torch", free >= MIN_FREE_GB,
             f"{free:.1f} GB free in {target}",
             "free some disk, or point --venv somewhere with room"),
        Need(f"{args.torch} for CUDA from {source}",
             True,  # not probed: pip says so in the report if it cannot be had
             "checked when pip installs it",
             "network access to that index, or --find-links DIR holding the wheels"),
    ]  # fmt: skip


@dataclass
class Step:
    """One step of the check: a command, and what came of it."""

    name: str
    argv: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    #: Seconds it may run; the check's budget may leave it less.
    timeout: float = 60.0
    #: Whether it counts against ``--budget-seconds`` (the install steps do not).
    budgeted: bool = True
    returncode: int | None = None
    seconds: float = 0.0
    output: str = ""

    @property
    def command(self) -> str:
        prefix = " ".join(f"{key}={value}" for key, value in self.environment.items())
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


def plan(
    args: argparse.Namespace, report_dir: Path, python: str | None = None
) -> tuple[str, list[Step]]:
    """The interpreter the checks run with, and every step, in order.

    ``python``: an interpreter with a CUDA torch, used as it is (stabmon from this checkout,
    on ``PYTHONPATH``); None installs a venv first.
    """
    steps: list[Step] = []
    environment: dict[str, str] = {}
    if python is not None:
        environment = {"PYTHONPATH": str(ROOT)}
    else:
        venv = Path(args.venv)
        python = str(venv / "bin" / "python")
        source = ["--find-links", args.find_links, "--no-index"] if args.find_links else [
            "--index-url", args.index_url]  # fmt: skip
        pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        steps += [
            Step("create the venv", [args.base_python, "-m", "venv", str(venv)],
                 timeout=120, budgeted=False),
            Step("install a CUDA torch", [*pip, args.torch, *source],
                 timeout=INSTALL_SECONDS, budgeted=False),
            Step("install stabmon", [*pip, "-e", ".[dev]"], timeout=600, budgeted=False),
        ]  # fmt: skip
    probe = (
        "import json, torch; assert torch.cuda.is_available(), 'this torch sees no CUDA device'; "
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'devices': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))"
    )
    # addopts cleared: the project's `--dist loadgroup` needs pytest-xdist, which need not be here.
    pytest = [python, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-rA", "-q",
              "--strict-markers"]  # fmt: skip
    gpt_json = report_dir / "gpu-check-gpt.json"
    steps += [
        Step("torch sees the GPU", [python, "-c", probe], environment, timeout=30),
        Step("gpu-marked tests", [*pytest, "-m", "gpu", *GPU_TEST_FILES], environment,
             timeout=120),
        Step("sync audit on fake CUDA", [*pytest, "-m", "not gpu", "tests/test_sync_audit.py"],
             environment, timeout=30),
        Step("GPT loop: MFU and overhead per step (GPT-2-small, small GPT), sync-checked",
             [python, "bench/gpu_gpt.py", "--compile", "no", "--json", str(gpt_json)],
             environment, timeout=100),
    ]  # fmt: skip
    return python, steps


def run_step(step: Step, seconds: float | None = None) -> None:
    """Run ``step`` for at most ``seconds`` (its own timeout by default); past that its whole
    process group is killed (a test's child processes too) and it exits 124."""
    limit = step.timeout if seconds is None else min(step.timeout, seconds)
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            step.argv, cwd=ROOT, env={**os.environ, **step.environment}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    except OSError as error:
        step.returncode, step.output = 127, f"could not run: {error}"
        step.seconds = time.monotonic() - started
        return
    try:
        step.output, _ = process.communicate(timeout=max(limit, 1.0))
        step.returncode = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        step.returncode = 124
        step.output = f"{output or ''}\ngpu-check: stopped after {limit:.0f} s (its time bound)"
    step.seconds = time.monotonic() - started
    if step.returncode == 0 and "-m" in step.argv and "gpu" in step.argv:
        skipped = [line for line in step.output.splitlines() if line.startswith("SKIPPED")]
        if skipped:  # on a GPU machine a gpu test that skips is a test that did not run
            step.returncode = 1
            step.output += "\ngpu-check: gpu-marked tests skipped on a GPU machine:\n" + "\n".join(
                skipped
            )


def report(path: Path, found: Sequence[Need], steps: Sequence[Step], smi: str) -> str:
    """The report's Markdown, written to ``path``."""
    passed = all(step.returncode == 0 for step in steps)
    lines = [
        "# stabmon gpu-check",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on "
        f"{platform.node()} ({platform.platform()}): **{'PASSED' if passed else 'FAILED'}**",
        "",
        "```text",
        smi.strip() or "(nvidia-smi printed nothing)",
        "```",
        "",
        "| requirement | found |",
        "|---|---|",
        *(f"| {need.what} | {need.found} |" for need in found),
        "",
        "| step | exit | seconds | command |",
        "|---|---:|---:|---|",
        *(
            f"| {step.name} | {step.returncode} | {step.seconds:.0f} | `{step.command}` |"
            for step in steps
        ),
    ]
    for number, step in enumerate(steps, 1):
        # The whole output beside the report (a failure's cause is often above the tail).
        log = path.with_name(f"{path.stem}-step{number}.log")
        log.write_text(step.output)
        tail = step.output.splitlines()[-OUTPUT_LINES:]
        lines += ["", f"## {step.name}", "", f"`{step.command}`: exit {step.returncode}; "
                  f"its last {OUTPUT_LINES} lines (all of them in {log.name}):", "",
                  "```text", *tail, "```"]  # fmt: skip
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check the needs, print the plan")
    parser.add_argument("--report", default="gpu-check-report.md", help="the report file")
    parser.add_argument("--venv", default=".venv-gpu", help="where the CUDA venv goes")
    parser.add_argument("--torch", default=DEFAULT_TORCH, help=f"default {DEFAULT_TORCH}")
    parser.add_argument(
        "--index-url",
        default=os.environ.get("TORCH_INDEX_URL", DEFAULT_INDEX_URL),
        help=f"CUDA wheel index (default $TORCH_INDEX_URL or {DEFAULT_INDEX_URL})",
    )
    parser.add_argument("--find-links", help="install torch from this wheelhouse, offline")
    parser.add_argument("--base-python", default=sys.executable, help="makes the venv")
    parser.add_argument("--python", help="an interpreter that has a CUDA torch: no venv made")
    parser.add_argument(
        "--install", action="store_true",
        help="make the venv with a CUDA torch even when this interpreter has one (workstation)",
    )  # fmt: skip
    parser.add_argument(
        "--budget-seconds", type=float, default=BUDGET_SECONDS,
        help=f"bound on the checks after any install (default {BUDGET_SECONDS:.0f})",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, probes: Probes | None = None) -> int:
    args = parse_args(argv)
    found = needs(args, probes or Probes())
    missing = [need for need in found if not need.met]
    report_path = (ROOT / args.report) if not Path(args.report).is_absolute() else Path(args.report)
    python, steps = plan(args, report_path.parent, interpreter(args, probes or Probes()))
    print("gpu-check needs:")
    for need in found:
        print(f"  [{'ok' if need.met else 'MISSING'}] {need.what}: {need.found}")
        if not need.met:
            print(f"            to get it: {need.remedy}")
    if args.dry_run or missing:
        print("\nplan (run from the repository root):")
        for number, step in enumerate(steps, 1):
            print(f"  {number}. {step.name} (at most {step.timeout:.0f} s):\n       {step.command}")
        print(f"  then the report: {report_path}")
    if missing:
        print(
            f"\ngpu-check: cannot run here: {len(missing)} requirement(s) missing "
            f"({'; '.join(need.what for need in missing)}); nothing was changed",
            file=sys.stderr,
        )
        return 2
    if args.dry_run:
        return 0
    smi = probes_run(probes or Probes(), ["nvidia-smi"])
    run_steps(steps, args.budget_seconds)
    ran = [step for step in steps if step.returncode is not None]
    report(report_path, found, ran, smi)
    gpt = report_path.parent / "gpu-check-gpt.json"
    if gpt.exists():
        print(gpt.read_text())
    passed = len(ran) == len(steps) and all(step.returncode == 0 for step in ran)
    print(f"gpu-check {'PASSED' if passed else 'FAILED'}: {report_path} ({python})")
    return 0 if passed else 1


def run_steps(steps: Sequence[Step], budget: float) -> None:
    """Run ``steps`` in order, the budgeted ones within ``budget`` seconds all together."""
    left = budget
    for step in steps:
        if step.budgeted and left < 1.0:
            print(f"gpu-check: {step.name}: no time left in the budget", file=sys.stderr)
            break
        print(f"gpu-check: {step.name} ...", file=sys.stderr, flush=True)
        run_step(step, left if step.budgeted else None)
        left -= step.seconds if step.budgeted else 0.0
        print(f"  exit {step.returncode} after {step.seconds:.0f} s", file=sys.stderr, flush=True)
        if step.returncode != 0 and step.name.startswith(("create", "install", "torch sees")):
            break  # without the interpreter nothing after can run


def probes_run(probes: Probes, argv: Sequence[str]) -> str:
    try:
        return probes.run(argv)
    except (OSError, subprocess.SubprocessError) as error:
        return f"{shlex.join(argv)} failed: {error}"


if __name__ == "__main__":
    sys.exit(main())
