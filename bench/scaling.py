"""Cost at scale: stabmon's step cost against the floor as parameter tensors and module groups grow.

The model is nothing but parameters: ``groups`` submodules holding ``tensors``
small tensors between them (64 elements each), and a loss that touches every one,
so a step is forward, backward, an SGD step and ``zero_grad`` over ``tensors``
tensors (at learning rate 0, so the weights, and the step, stay the same however many
steps run), and the cost that grows with their number is what is measured.

stabmon's cost is timed directly, not as the difference of two step times: at 1,000
tensors and more it is a few percent of a step or less, and two models trained side by
side differ by that much (memory layout), as does one model from one second to the
next on a shared machine. Each step, stopwatch hooks registered before ``attach()``
and after it bracket stabmon's four hooks (torch runs hooks in the order they were
registered), and a stopwatch brackets ``observe(loss)``; the floor's read (one fused
``_foreach_norm``, stacked and checked on the device, as in ``overhead.py``) is timed
in the same step, after the optimizer step, so the gradients are already in cache for
it and not for stabmon. The stopwatches' own cost, measured the same way with nothing
between them, is subtracted. Reported are medians over steps of the training thread's
CPU time (``time.thread_time``, one torch thread: a neighbour on a shared machine takes
wall time from whatever it lands in, not CPU time), with Python's garbage collector off
while steps are timed (as ``timeit`` does): *stabmon*, the time of its hooks and
``observe()`` per step; *floor read*, the fused read; and *stabmon / floor* as
``overhead.py`` defines it, the step with stabmon over the step with the floor's read
instead, both built from the same step's timings.

Usage::

    python bench/scaling.py             # both sweeps: the tables in bench/README.md
    python bench/scaling.py --quick     # a few steps of small shapes: a smoke test
"""

from __future__ import annotations

import argparse
import gc
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import stabmon
from stabmon.export.families import registry_sum

#: Elements per parameter tensor: small, so the per-tensor costs are what grows.
TENSOR_NUMEL = 64
#: Parameter tensors, 8 module groups: the first sweep.
TENSOR_COUNTS = (10, 100, 1_000, 10_000)
TENSORS_GROUPS = 8
#: Module groups over 1,000 tensors: the second sweep, up to the default max_modules (32) and
#: beyond it, where the smallest groups share the label "other".
GROUP_COUNTS = (1, 4, 16, 32, 64)
GROUPS_TENSORS = 1_000
#: Timed steps per shape: about this many seconds of steps, within these bounds.
SECONDS_PER_SHAPE = 4.0
MIN_STEPS, MAX_STEPS = 20, 2_000
WARMUP_STEPS = 20


class Parameters(nn.Module):
    """``groups`` submodules named ``g0``, ``g1``...; ``tensors`` parameters spread over them."""

    def __init__(self, tensors: int, groups: int) -> None:
        super().__init__()
        sizes = [tensors // groups + (1 if g < tensors % groups else 0) for g in range(groups)]
        self.parts = nn.ModuleDict(
            {
                f"g{g}": nn.ParameterList(
                    nn.Parameter(torch.randn(TENSOR_NUMEL) * 0.1) for _ in range(size)
                )
                for g, size in enumerate(sizes)
            }
        )
        self._flat = list(self.parameters())

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return (torch.cat(self._flat) * scale).pow(2).sum()


class Stopwatch:
    """Adds up the intervals between ``start`` and ``stop``; both take any hook's arguments."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def start(self, *args: Any) -> None:
        self._started = time.thread_time()

    def stop(self, *args: Any) -> None:
        self.seconds += time.thread_time() - self._started


def _bracket(
    model: nn.Module, optimizer: torch.optim.Optimizer, call: Any
) -> list[torch.utils.hooks.RemovableHandle]:
    return [
        model.register_forward_pre_hook(call),
        model.register_forward_hook(call),
        optimizer.register_step_pre_hook(call),
        optimizer.register_step_post_hook(call),
    ]


def _floor_read(parameters: Sequence[torch.Tensor]) -> None:
    grads = [p.grad for p in parameters if p.grad is not None]
    torch.isfinite(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0))))


@dataclass(frozen=True)
class Result:
    tensors: int
    groups: int
    steps: int
    #: Medians over steps, in microseconds.
    plain_us: float
    floor_us: float
    stabmon_us: float

    @property
    def ratio(self) -> float:
        """The step with stabmon over the step with the floor's read (overhead.py's ratio)."""
        return (self.plain_us + self.stabmon_us) / (self.plain_us + self.floor_us)


def _timed_steps(
    tensors: int, groups: int, run_dir: Path, *, attach: bool, steps: int | None = None
) -> tuple[int, list[tuple[float, float, float]]]:
    """(steps, [(plain, floor read, bracketed) seconds per step]) on a fresh model."""
    torch.manual_seed(0)
    model = Parameters(tensors, groups)
    # lr 0: every kernel of the step runs, and the weights stay as they are. Trained, this
    # loss drives them to zero through denormals (slow on a CPU, so the step time drifts) and
    # the gradients to exactly zero (dead to stabmon).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    parameters = list(model.parameters())
    watch = Stopwatch()
    handles = _bracket(model, optimizer, watch.start)
    monitor = None
    if attach:
        monitor = stabmon.attach(model, optimizer, port=0, run_dir=str(run_dir), event_log=False)
    handles += _bracket(model, optimizer, watch.stop)
    scale = torch.tensor(1.0)

    def step() -> tuple[float, float, float]:
        watch.seconds = 0.0
        started = time.thread_time()
        loss = model(scale)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        optimizer.step()
        read = time.thread_time()
        _floor_read(parameters)
        floor = time.thread_time() - read
        optimizer.zero_grad()
        watch.start()
        if monitor is not None:
            monitor.observe(loss=loss)
        watch.stop()
        total = time.thread_time() - started
        return total - floor - watch.seconds, floor, watch.seconds

    try:
        warm = [step() for _ in range(WARMUP_STEPS)]
        if steps is None:
            per_step = statistics.median(sum(times) for times in warm)
            steps = min(MAX_STEPS, max(MIN_STEPS, round(SECONDS_PER_SHAPE / per_step)))
        gc.collect()
        gc.disable()  # as timeit does: a collection pause lands in whichever step it hits
        try:
            timed = [step() for _ in range(steps)]
        finally:
            gc.enable()
        if monitor is not None:
            errors = registry_sum(monitor.registry, "stabmon_internal_errors_total")
            if errors:
                raise RuntimeError(f"stabmon contained {errors:.0f} internal error(s): void")
    finally:
        if monitor is not None:
            monitor.detach()
        for handle in handles:
            handle.remove()
    return steps, timed


def measure(tensors: int, groups: int, run_dir: Path, steps: int | None = None) -> Result:
    """stabmon's own time per step and the floor's read on one shape; medians over steps."""
    count, timed = _timed_steps(tensors, groups, run_dir, attach=True, steps=steps)
    _, empty = _timed_steps(tensors, groups, run_dir, attach=False, steps=count)
    stopwatches = statistics.median(bracketed for _, _, bracketed in empty)
    return Result(
        tensors=tensors,
        groups=groups,
        steps=count,
        plain_us=statistics.median(plain for plain, _, _ in timed) * 1e6,
        floor_us=statistics.median(floor for _, floor, _ in timed) * 1e6,
        stabmon_us=max(0.0, statistics.median(b for _, _, b in timed) - stopwatches) * 1e6,
    )


def format_table(title: str, results: Sequence[Result]) -> str:
    lines = [
        title,
        "",
        "| parameter tensors | module groups | steps | plain step, ms | floor read, us | "
        "stabmon, us | stabmon per tensor, ns | stabmon / floor read | stabmon / floor |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.tensors:,} | {r.groups} | {r.steps} | {r.plain_us / 1e3:.2f} | "
            f"{r.floor_us:.1f} | {r.stabmon_us:.1f} | {r.stabmon_us * 1e3 / r.tensors:.0f} | "
            f"{r.stabmon_us / r.floor_us:.2f} | {r.ratio:.4f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 steps of small shapes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    counts = TENSOR_COUNTS[:2] if args.quick else TENSOR_COUNTS
    group_counts = GROUP_COUNTS[:2] if args.quick else GROUP_COUNTS
    group_tensors = 100 if args.quick else GROUPS_TENSORS
    steps = MIN_STEPS if args.quick else None
    arguments = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join([".venv/bin/python", "bench/scaling.py", *arguments])
    print(
        f"`{command}`: torch {torch.__version__}, {args.threads} torch thread(s), "
        f"{platform.machine()}, {TENSOR_NUMEL} elements per tensor, SGD(lr=0, momentum=0.9), "
        "default stabmon config (measure_every 1, max_modules 32); medians over steps\n",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="stabmon-scaling-") as tmp:
        by_tensors = []
        for count in counts:
            by_tensors.append(measure(count, TENSORS_GROUPS, Path(tmp), steps))
            print(f"  {count} tensors done", file=sys.stderr, flush=True)
        title = f"Parameter tensors grow ({TENSORS_GROUPS} module groups):"
        print(format_table(title, by_tensors), flush=True)
        by_groups = []
        for groups in group_counts:
            by_groups.append(measure(group_tensors, groups, Path(tmp), steps))
            print(f"  {groups} groups done", file=sys.stderr, flush=True)
        title = (
            f"Module groups grow ({group_tensors:,} tensors; beyond max_modules (32) the "
            "smallest groups share the label 'other'):"
        )
        print("\n" + format_table(title, by_groups), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
