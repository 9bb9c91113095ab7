"""`make gpu-check`: everything stabmon claims about CUDA, run on a real GPU, in one report file.

On a machine with an NVIDIA GPU this script

1. creates its own venv (``.venv-gpu``) and installs a CUDA build of torch into it from
   PyTorch's CUDA wheel index (or a wheelhouse: ``--find-links``), then stabmon with its
   dev extras; ``--python`` uses an interpreter that already has a CUDA torch instead;
2. runs every ``gpu``-marked test (``pytest -m gpu``): a gpu test that skips there fails
   the check;
3. runs the sync check: ``tests/test_sync_audit.py``, the fake-CUDA audit and the same
   phases on the real device under ``torch.cuda.set_sync_debug_mode("error")``;
4. runs the overhead benchmark's GPU workload (``bench/overhead.py --device cuda``: plain,
   the floor and stabmon in rotated, order-reversed rounds, every stabmon, floor and plain
   segment under sync-debug "error");
5. runs the daemon against the real NVML with a CUDA training process pinned by
   ``CUDA_VISIBLE_DEVICES`` (``tests/integration/test_daemon_real_nvml.py``);

and writes one Markdown report (``gpu-check-report.md``): the machine, each step's
command, exit status, time and output. It exits 0 when every step passed, 1 otherwise.

Where something it needs is missing (no GPU, no driver, no venv module, too little disk)
it says what, and how to get it, and exits 2 before changing anything. ``--dry-run``
checks the same and prints the plan without running it. Standard library only: it runs
under the system Python, which need not have torch.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import shlex
import shutil
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


def needs(args: argparse.Namespace, probes: Probes) -> list[Need]:
    """Every requirement of the check, each with what was found."""
    found: list[Need] = []
    smi = probes.which("nvidia-smi")
    gpus: list[str] = []
    if smi is not None:
        try:
            gpus = [line for line in probes.run([smi, "-L"]).splitlines() if line.startswith("GPU")]
        except (OSError, subprocess.SubprocessError) as error:
            gpus, smi = [], f"{smi} (fails: {error})"
    found.append(
        Need(
            "an NVIDIA GPU, listed by `nvidia-smi -L`",
            bool(gpus),
            "; ".join(gpus) if gpus else (smi or "no nvidia-smi on PATH"),
            "run on a machine with an NVIDIA GPU and its driver installed",
        )
    )
    try:
        probes.load_library("libnvidia-ml.so.1")
        nvml, where = True, "libnvidia-ml.so.1 loads"
    except OSError as error:
        nvml, where = False, f"libnvidia-ml.so.1 does not load ({error})"
    found.append(Need("the NVIDIA driver's NVML library", nvml, where,
                      "install the NVIDIA driver (it ships libnvidia-ml.so.1)"))  # fmt: skip
    if args.python:
        python = args.python
        torch_ok = probes.has_module(python, "torch")
        found.append(Need(f"a CUDA build of torch in {python}", torch_ok,
                          "torch imports" if torch_ok else "torch does not import",
                          "install a CUDA torch there, or leave out --python"))  # fmt: skip
    else:
        venv_ok = probes.has_module(args.base_python, "venv") and probes.has_module(
            args.base_python, "ensurepip"
        )
        found.append(
            Need(
                f"{args.base_python} with the venv and ensurepip modules (Python >= 3.10)",
                venv_ok,
                "present" if venv_ok else "missing",
                "install python3-venv (Debian/Ubuntu: apt-get install python3-venv)",
            )
        )
        target = Path(args.venv).resolve().parent
        free = probes.free_bytes(target) / 1e9
        found.append(
            Need(
                f"{MIN_FREE_GB:.0f} GB free for the venv's CUDA torch",
                free >= MIN_FREE_GB,
                f"{free:.1f} GB free in {target}",
                "free some disk, or point --venv somewhere with room",
            )
        )
        source = f"--find-links {args.find_links}" if args.find_links else args.index_url
        found.append(
            Need(
                f"{args.torch} for CUDA from {source}",
                True,  # not probed: pip says so in the report if it cannot be had
                "checked when pip installs it",
                "network access to that index, or --find-links DIR holding the wheels",
            )
        )
    return found


@dataclass
class Step:
    """One step of the check: a command, and what came of it."""

    name: str
    argv: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    returncode: int | None = None
    seconds: float = 0.0
    output: str = ""

    @property
    def command(self) -> str:
        prefix = " ".join(f"{key}={value}" for key, value in self.environment.items())
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


def plan(args: argparse.Namespace, report_dir: Path) -> tuple[str, list[Step]]:
    """The interpreter the checks run with, and every step, in order."""
    steps: list[Step] = []
    if args.python:
        python = args.python
    else:
        venv = Path(args.venv)
        python = str(venv / "bin" / "python")
        source = ["--find-links", args.find_links, "--no-index"] if args.find_links else [
            "--index-url", args.index_url]  # fmt: skip
        steps += [
            Step("create the venv", [args.base_python, "-m", "venv", str(venv)]),
            Step("install a CUDA torch", [python, "-m", "pip", "install", "--quiet",
                                          "--disable-pip-version-check", args.torch, *source]),
            Step("install stabmon", [python, "-m", "pip", "install", "--quiet",
                                     "--disable-pip-version-check", "-e", ".[dev]"]),
        ]  # fmt: skip
    probe = (
        "import json, torch; assert torch.cuda.is_available(), 'this torch sees no CUDA device'; "
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'devices': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))"
    )
    pytest = [python, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q"]
    overhead_json = report_dir / "gpu-check-overhead.json"
    steps += [
        Step("torch sees the GPU", [python, "-c", probe]),
        Step("every gpu-marked test", [*pytest, "-m", "gpu", "tests"]),
        Step("sync check (fake audit, then the device under sync-debug error)",
             [*pytest, "tests/test_sync_audit.py"]),
        Step("overhead benchmark, GPU workload (plain, floor, stabmon)",
             [python, "bench/overhead.py", "--device", "cuda", "--no-peers",
              "--json", str(overhead_json)]),
        Step("daemon on real NVML, trainee pinned by CUDA_VISIBLE_DEVICES",
             [*pytest, "tests/integration/test_daemon_real_nvml.py"]),
    ]  # fmt: skip
    return python, steps


def run_step(step: Step) -> None:
    started = time.monotonic()
    try:
        done = subprocess.run(
            step.argv, cwd=ROOT, env={**os.environ, **step.environment},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600,
        )  # fmt: skip
        step.returncode, step.output = done.returncode, done.stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        step.returncode, step.output = 127, f"could not run: {error}"
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
    for step in steps:
        tail = step.output.splitlines()[-OUTPUT_LINES:]
        lines += ["", f"## {step.name}", "", f"`{step.command}`: exit {step.returncode}", "",
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
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, probes: Probes | None = None) -> int:
    args = parse_args(argv)
    found = needs(args, probes or Probes())
    missing = [need for need in found if not need.met]
    report_path = (ROOT / args.report) if not Path(args.report).is_absolute() else Path(args.report)
    python, steps = plan(args, report_path.parent)
    print("gpu-check needs:")
    for need in found:
        print(f"  [{'ok' if need.met else 'MISSING'}] {need.what}: {need.found}")
        if not need.met:
            print(f"            to get it: {need.remedy}")
    if args.dry_run or missing:
        print("\nplan (run from the repository root):")
        for number, step in enumerate(steps, 1):
            print(f"  {number}. {step.name}:\n       {step.command}")
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
    for step in steps:
        print(f"gpu-check: {step.name} ...", file=sys.stderr, flush=True)
        run_step(step)
        print(f"  exit {step.returncode} after {step.seconds:.0f} s", file=sys.stderr, flush=True)
        if step.returncode != 0 and step.name.startswith(("create", "install", "torch sees")):
            break  # without the interpreter nothing after can run
    ran = [step for step in steps if step.returncode is not None]
    report(report_path, found, ran, smi)
    overhead = report_path.parent / "gpu-check-overhead.json"
    if overhead.exists():
        print(json.dumps(json.loads(overhead.read_text()).get("header", {}), indent=1))
    passed = len(ran) == len(steps) and all(step.returncode == 0 for step in ran)
    print(f"gpu-check {'PASSED' if passed else 'FAILED'}: {report_path} ({python})")
    return 0 if passed else 1


def probes_run(probes: Probes, argv: Sequence[str]) -> str:
    try:
        return probes.run(argv)
    except (OSError, subprocess.SubprocessError) as error:
        return f"{shlex.join(argv)} failed: {error}"


if __name__ == "__main__":
    sys.exit(main())
