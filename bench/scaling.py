"""Cost at scale: stabmon's step cost against the floor as parameter tensors and module groups grow.

The model is nothing but parameters: ``groups`` submodules holding ``tensors``
small tensors between them (64 elements each), and a loss that touches every one,
so a step is forward, backward, an SGD step and ``zero_grad`` over ``tensors``
tensors (at learning rate 0, so the weights, and the step, stay the same however many
steps run), and the cost that grows with their number is what is measured. For each
shape, stabmon (default config, ``observe(loss)`` every step) and the floor (one
fused ``_foreach_norm`` read, stacked and checked on the device, as in
``overhead.py``) are set up side by side on identical models and take turns in
short blocks, the order flipped every other pair (see ``overhead.py``): the table
gives the median over pairs of *stabmon - floor* per step and of *stabmon / floor*.
Blocks are timed in CPU time of the training thread (``time.thread_time``, one torch
thread), not wall time: on a shared machine a neighbour's burst takes wall time from
whichever block it lands in, and at 10,000 tensors a block is one 100 ms step. What
stabmon's background threads do (memory sampling, judging in a quiet loop) is not in the
figure; in a running loop stabmon judges on the training thread, at step ends. Python's
garbage collector is off while blocks are timed, as ``timeit`` does: with 10,000
parameters a collection pause is a sizeable fraction of a step, wherever it lands.

Usage::

    python bench/scaling.py                # both sweeps, the table as printed in bench/README.md
    python bench/scaling.py --quick        # a few pairs each: a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import stabmon

#: Elements per parameter tensor: small, so the per-tensor costs are what grows.
TENSOR_NUMEL = 64
#: Parameter tensors, 8 module groups: the first sweep.
TENSOR_COUNTS = (10, 100, 1_000, 10_000)
TENSORS_GROUPS = 8
#: Module groups over 1,000 tensors: the second sweep, up to the default max_modules (32) and
#: beyond it, where the smallest groups share the label "other".
GROUP_COUNTS = (1, 4, 16, 32, 64)
GROUPS_TENSORS = 1_000
#: Each block runs about this long (at least one step).
BLOCK_SECONDS = 0.1
StepFn = Callable[[], None]


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


@contextlib.contextmanager
def _floor(model: Parameters, optimizer: torch.optim.Optimizer) -> Iterator[StepFn]:
    parameters = list(model.parameters())

    def before_step() -> None:
        grads = [p.grad for p in parameters if p.grad is not None]
        torch.isfinite(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0))))

    yield _step_fn(model, optimizer, before_step=before_step)


@contextlib.contextmanager
def _stabmon(
    model: Parameters, optimizer: torch.optim.Optimizer, run_dir: Path
) -> Iterator[StepFn]:
    monitor = stabmon.attach(model, optimizer, port=0, run_dir=str(run_dir), event_log=False)
    try:
        yield _step_fn(model, optimizer, observe=monitor.observe)
        errors = sum(
            sample.value
            for family in monitor.registry.collect()
            for sample in family.samples
            if sample.name == "stabmon_internal_errors_total"
        )
        if errors:
            raise RuntimeError(f"stabmon contained {errors:.0f} internal error(s): result void")
    finally:
        monitor.detach()


def _step_fn(
    model: Parameters,
    optimizer: torch.optim.Optimizer,
    *,
    before_step: StepFn | None = None,
    observe: Callable[..., None] | None = None,
) -> StepFn:
    scale = torch.tensor(1.0)

    def step() -> None:
        loss = model(scale)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        if before_step is not None:
            before_step()
        optimizer.step()
        optimizer.zero_grad()
        if observe is not None:
            observe(loss=loss)

    return step


@dataclass(frozen=True)
class Result:
    tensors: int
    groups: int
    floor_ms: float
    difference_us: float
    ratio: float
    ratio_p10: float
    ratio_p90: float


def measure(tensors: int, groups: int, pairs: int, run_dir: Path) -> Result:
    """stabmon against the floor on one shape, in interleaved blocks of about BLOCK_SECONDS."""
    with contextlib.ExitStack() as stack:
        steps: list[StepFn] = []
        for variant in ("floor", "stabmon"):
            torch.manual_seed(0)
            model = Parameters(tensors, groups)
            # lr 0: every kernel of the step runs, and the weights stay as they are. Trained,
            # this loss drives them to zero through denormals (slow on a CPU, so the step
            # time drifts) and the gradients to exactly zero (dead to stabmon).
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
            manager = (
                _floor(model, optimizer)
                if variant == "floor"
                else _stabmon(model, optimizer, run_dir)
            )
            steps.append(stack.enter_context(manager))
        start = time.perf_counter()
        for _ in range(3):
            steps[0]()
        block = max(1, round(BLOCK_SECONDS / ((time.perf_counter() - start) / 3)))
        for step in steps:
            for _ in range(3 * block):
                step()
        gc.collect()

        def run(which: int) -> float:
            step = steps[which]
            started = time.thread_time()
            for _ in range(block):
                step()
            return (time.thread_time() - started) / block

        times: list[tuple[float, float]] = []
        gc.disable()  # as timeit does: a collection pause lands in whichever block it hits
        try:
            for pair in range(pairs):
                if pair % 2:
                    ours, floors = run(1), run(0)
                else:
                    floors, ours = run(0), run(1)
                times.append((floors, ours))
        finally:
            gc.enable()
    ratios = [ours / floors for floors, ours in times]
    deciles = statistics.quantiles(ratios, n=10, method="inclusive")
    return Result(
        tensors=tensors,
        groups=groups,
        floor_ms=statistics.median(floors for floors, _ in times) * 1e3,
        difference_us=statistics.median((ours - floors) * 1e6 for floors, ours in times),
        ratio=statistics.median(ratios),
        ratio_p10=deciles[0],
        ratio_p90=deciles[-1],
    )


def format_table(title: str, results: Sequence[Result]) -> str:
    lines = [
        title,
        "",
        "| parameter tensors | module groups | floor step, CPU ms | stabmon - floor, us/step | "
        "stabmon - floor, ns per tensor | stabmon / floor (p10-p90) |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.tensors:,} | {r.groups} | {r.floor_ms:.2f} | {r.difference_us:.1f} | "
            f"{r.difference_us * 1e3 / r.tensors:.0f} | {r.ratio:.3f} "
            f"({r.ratio_p10:.3f}-{r.ratio_p90:.3f}) |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100, help="block pairs per shape (100)")
    parser.add_argument("--quick", action="store_true", help="4 pairs per shape, small shapes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    args = parser.parse_args(argv)
    if args.pairs < 2:
        parser.error(f"--pairs must be >= 2, got {args.pairs}")
    torch.set_num_threads(args.threads)
    pairs = 4 if args.quick else args.pairs
    counts = TENSOR_COUNTS[:2] if args.quick else TENSOR_COUNTS
    group_counts = GROUP_COUNTS[:2] if args.quick else GROUP_COUNTS
    group_tensors = 100 if args.quick else GROUPS_TENSORS
    command = shlex.join([".venv/bin/python", "bench/scaling.py", *(argv or sys.argv[1:])])
    print(
        f"`{command}`: torch {torch.__version__}, {args.threads} thread(s), "
        f"{platform.processor() or platform.machine()}, {pairs} block pairs per shape, "
        f"{TENSOR_NUMEL} elements per tensor, SGD(lr=0, momentum=0.9), default stabmon config\n",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="stabmon-scaling-") as tmp:
        by_tensors = []
        for count in counts:
            by_tensors.append(measure(count, TENSORS_GROUPS, pairs, Path(tmp)))
            print(f"  {count} tensors done", file=sys.stderr, flush=True)
        print(format_table(f"Parameter tensors grow ({TENSORS_GROUPS} module groups):",
                           by_tensors), flush=True)  # fmt: skip
        by_groups = []
        for groups in group_counts:
            by_groups.append(measure(group_tensors, groups, pairs, Path(tmp)))
            print(f"  {groups} groups done", file=sys.stderr, flush=True)
        print("\n" + format_table(
            f"Module groups grow ({group_tensors:,} tensors; max_modules 32, beyond it the "
            "smallest groups share 'other'):", by_groups), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
