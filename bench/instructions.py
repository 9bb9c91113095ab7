"""Instructions per training step, counted by callgrind: a noise-free view of the overhead.

On a shared machine a few microseconds per step drown in the noise of timing; the
number of instructions the training thread executes does not. Each variant of
``variants.py`` runs in its own process under ``valgrind --tool=callgrind``:
warm-up steps, then ``--steps`` counted steps between two dump points, on the
training thread only (stabmon's own background threads are left out: they run
by wall time, and valgrind's slowdown would inflate them per step).

Usage (valgrind must be installed; each variant takes a few minutes)::

    python bench/instructions.py plain floor stabmon
    python bench/instructions.py --steps 300 torch_hooks stabmon_hooks_only

Instructions are not time: Python code runs at a lower rate per instruction
than PyTorch's kernels, and cold code lower still, so use this to compare changes,
and ``overhead.py`` for what a step costs. Batching does not show here: stabmon
judges read-back results in batches at most ``judge_seconds`` apart, which under
valgrind's slowdown is every step or two; in real time the batching saves time
(``overhead.py`` measures it) while it executes slightly more instructions.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WARMUP_STEPS = 300
DEFAULT_STEPS = 500


def run_inner(variant_name: str, steps: int) -> None:
    """Inside valgrind: warm up, mark, run ``steps`` steps, mark (``--dump-before=getppid``)."""
    import torch
    from variants import Context
    from workloads import batch_pool, build_workload

    torch.set_num_threads(1)
    variant = known_variants()[variant_name]
    workload = build_workload("tiny", 0)
    batches = batch_pool(workload, 0)
    scratch = tempfile.TemporaryDirectory()
    with scratch, variant(workload, Context(Path(scratch.name))) as step:
        for index in range(WARMUP_STEPS):
            step(batches[index % len(batches)])
        os.getppid()  # dump point: everything before the counted steps
        for index in range(steps):
            step(batches[index % len(batches)])
        os.getppid()  # dump point: the counted steps


def known_variants() -> dict[str, Any]:
    """The CPU variants without peers: the core ones and the breakdown's."""
    from variants import select

    return select(peers=False, breakdown=True)[0]


def count(variant_name: str, steps: int, directory: Path) -> int:
    """Instructions per step of ``variant_name`` on the training thread."""
    out = directory / f"{variant_name}.callgrind"
    subprocess.run(
        [
            "valgrind", "--tool=callgrind", "--separate-threads=yes", "--dump-before=getppid",
            f"--callgrind-out-file={out}", sys.executable, __file__, "--inner", variant_name,
            "--steps", str(steps),
        ],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    # Dump 2 holds what ran between the two marks; thread 01 is the training thread.
    text = Path(f"{out}.2-01").read_text()
    match = re.search(r"^(?:summary|totals): (\d+)", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no instruction total in {out}.2-01")
    return int(match.group(1)) // steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("variants", nargs="*", default=["plain", "floor", "stabmon"])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="counted steps")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        run_inner(args.inner, args.steps)
        return 0
    unknown = sorted(set(args.variants) - set(known_variants()))
    if unknown:
        print(f"instructions.py: unknown variant(s) {', '.join(unknown)}; "
              f"choose from {', '.join(known_variants())}")  # fmt: skip
        return 2
    if shutil.which("valgrind") is None:
        print("instructions.py: valgrind is not installed (apt-get install valgrind)")
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        print(f"tiny workload, {args.steps} steps after {WARMUP_STEPS}; training thread only")
        for name in args.variants:
            print(f"{name:<20} {count(name, args.steps, Path(scratch)):>12,} instructions/step")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main())
