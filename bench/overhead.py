"""Per-step overhead of stabmon against a plain CPU training step.

Each round times every variant on an identical model (same seed, same batches),
in an order rotated every two rounds and reversed every other round, so each
pair of variants runs in both orders and machine drift cancels. The figure of
merit is the median over rounds of the paired ratio variant time / plain time.

Usage::

    python bench/overhead.py             # full run (16 rounds, ~1 s per variant per round)
    python bench/overhead.py --quick     # smoke test (5 rounds x 20 steps)
    python bench/overhead.py --json out.json
    python bench/overhead.py --steps-rss 100000   # RSS of a long stabmon run (manual)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import itertools
import json
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

import stabmon

Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[Batch], None]
GradCheck = Callable[[], object]

# One thread: on a shared 2-core box, two OpenMP threads turned a neighbour's burst into
# 10x slower rounds; `--threads` measures other settings.
DEFAULT_THREADS = 1
DEFAULT_ROUNDS = 16  # even, so every pair of variants runs equally often in each order
WARMUP_STEPS = 5
TARGET_SECONDS = 1.0  # plain-loop time of one variant's timed segment in one round
BATCH_POOL = 16  # distinct batches, cycled; the same pool for every variant of a round
QUICK_ROUNDS = 5
QUICK_STEPS = 20


# --- workloads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A freshly seeded model, its optimizer and loss, and how to draw one batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    make_batch: Callable[[torch.Generator], Batch]
    description: str


def _mlp(widths: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(fan_in, fan_out))
        if index < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def mlp17m() -> Workload:
    """A ~17M-parameter MLP, batch 64, SGD with momentum, MSE loss."""
    widths = (1024, 4096, 2048, 1024, 1024, 1024)
    batch = 64
    model = _mlp(widths)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def make_batch(generator: torch.Generator) -> Batch:
        inputs = torch.randn(batch, widths[0], generator=generator)
        targets = torch.randn(batch, widths[-1], generator=generator)
        return inputs, targets

    description = f"MLP {'-'.join(map(str, widths))}, batch {batch}, SGD(momentum=0.9), MSE loss"
    return Workload(model, optimizer, nn.functional.mse_loss, make_batch, description)


def tiny() -> Workload:
    """A tiny MLP, batch 32, where Python overhead dominates the step."""
    widths = (32, 64, 64, 10)
    batch = 32
    model = _mlp(widths)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def make_batch(generator: torch.Generator) -> Batch:
        inputs = torch.randn(batch, widths[0], generator=generator)
        targets = torch.randint(0, widths[-1], (batch,), generator=generator)
        return inputs, targets

    description = (
        f"MLP {'-'.join(map(str, widths))}, batch {batch}, SGD(momentum=0.9), cross-entropy loss"
    )
    return Workload(model, optimizer, nn.functional.cross_entropy, make_batch, description)


WORKLOADS: dict[str, Callable[[], Workload]] = {"mlp17m": mlp17m, "tiny": tiny}


def build_workload(name: str, seed: int) -> Workload:
    """Build workload ``name`` with every parameter drawn from ``seed``."""
    torch.manual_seed(seed)
    return WORKLOADS[name]()


def parameter_count(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def batch_pool(workload: Workload, seed: int, size: int = BATCH_POOL) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [workload.make_batch(generator) for _ in range(size)]


# --- variants --------------------------------------------------------------------------------


def _step_fn(
    workload: Workload,
    *,
    before_step: GradCheck | None = None,
    after_step: Callable[[torch.Tensor], None] | None = None,
) -> StepFn:
    model, optimizer, loss_fn = workload.model, workload.optimizer, workload.loss_fn

    def step(batch: Batch) -> None:
        inputs, targets = batch
        loss = loss_fn(model(inputs), targets)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        if before_step is not None:
            before_step()
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(loss)

    return step


@contextlib.contextmanager
def plain(workload: Workload, run_dir: Path) -> Iterator[StepFn]:
    """Forward, backward, optimizer.step(), zero_grad()."""
    yield _step_fn(workload)


@contextlib.contextmanager
def floor(workload: Workload, run_dir: Path) -> Iterator[StepFn]:
    """Plain + one fused on-device read of every gradient: the cost floor."""
    parameters = list(workload.model.parameters())

    def fused_read() -> torch.Tensor:
        grads = [p.grad for p in parameters if p.grad is not None]
        norms = torch._foreach_norm(grads, 2.0)
        total = torch.linalg.vector_norm(torch.stack(norms))
        return torch.isfinite(total)  # stays on device: no .item()

    yield _step_fn(workload, before_step=fused_read)


def _stabmon(workload: Workload, run_dir: Path, **overrides: Any) -> Iterator[StepFn]:
    monitor = stabmon.attach(
        workload.model,
        workload.optimizer,
        port=0,
        run_dir=str(run_dir),
        event_log=False,
        **overrides,
    )
    try:
        yield _step_fn(workload, after_step=lambda loss: monitor.observe(loss=loss))
    finally:
        monitor.detach()


@contextlib.contextmanager
def stabmon_default(workload: Workload, run_dir: Path) -> Iterator[StepFn]:
    """stabmon.attach with default config; observe(loss=loss) every step."""
    yield from _stabmon(workload, run_dir)


@contextlib.contextmanager
def stabmon_every10(workload: Workload, run_dir: Path) -> Iterator[StepFn]:
    """As stabmon, with measure_every=10."""
    yield from _stabmon(workload, run_dir, measure_every=10)


@contextlib.contextmanager
def manual(workload: Workload, run_dir: Path) -> Iterator[StepFn]:
    """The usual hand-written monitor: norm().item() and isnan().any().item() per parameter."""
    parameters = list(workload.model.parameters())

    def per_parameter_read() -> list[tuple[float, bool]]:
        return [
            (p.grad.norm().item(), bool(torch.isnan(p.grad).any().item()))
            for p in parameters
            if p.grad is not None
        ]

    yield _step_fn(workload, before_step=per_parameter_read)


Variant = Callable[[Workload, Path], contextlib.AbstractContextManager[StepFn]]
VARIANTS: dict[str, Variant] = {
    "plain": plain,
    "floor": floor,
    "stabmon": stabmon_default,
    "stabmon_every10": stabmon_every10,
    "manual": manual,
}


# --- timing ----------------------------------------------------------------------------------


def round_order(round_index: int, names: Sequence[str]) -> list[str]:
    """Rotate every two rounds and reverse odd rounds, so each pair meets in both orders."""
    shift = (round_index // 2) % len(names)
    order = list(names[shift:]) + list(names[:shift])
    return order[::-1] if round_index % 2 else order


def time_segment(
    workload_name: str, variant: Variant, steps: int, seed: int, run_dir: Path
) -> float:
    """Seconds for ``steps`` steps of ``variant`` after WARMUP_STEPS untimed steps."""
    workload = build_workload(workload_name, seed)
    batches = batch_pool(workload, seed)
    with variant(workload, run_dir) as step:
        for index in range(WARMUP_STEPS):
            step(batches[index % len(batches)])
        gc.collect()
        start = time.perf_counter()
        for index in range(steps):
            step(batches[index % len(batches)])
        return time.perf_counter() - start


def calibrate_steps(workload_name: str, seed: int, run_dir: Path) -> int:
    """Steps whose plain loop takes about TARGET_SECONDS."""
    probe_steps = 10
    seconds = time_segment(workload_name, plain, probe_steps, seed, run_dir)
    while seconds < 0.2:  # too short to trust: grow the probe
        probe_steps *= 4
        seconds = time_segment(workload_name, plain, probe_steps, seed, run_dir)
    return max(10, round(TARGET_SECONDS * probe_steps / seconds))


@dataclass(frozen=True)
class Row:
    variant: str
    ratio_median: float
    ratio_p10: float
    ratio_p90: float
    vs_floor_median: float
    step_ms_median: float
    added_us_median: float


@dataclass(frozen=True)
class WorkloadResult:
    name: str
    description: str
    parameters: int
    steps: int
    rounds: list[dict[str, float]]  # seconds per variant, one dict per round
    orders: list[list[str]]
    rows: list[Row]


def _p10_p90(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], deciles[-1]


def summarize(rounds: Sequence[dict[str, float]], steps: int) -> list[Row]:
    rows = []
    for name in VARIANTS:
        ratios = [r[name] / r["plain"] for r in rounds]
        vs_floor = [r[name] / r["floor"] for r in rounds]
        added_us = [(r[name] - r["plain"]) / steps * 1e6 for r in rounds]
        p10, p90 = _p10_p90(ratios)
        rows.append(
            Row(
                variant=name,
                ratio_median=statistics.median(ratios),
                ratio_p10=p10,
                ratio_p90=p90,
                vs_floor_median=statistics.median(vs_floor),
                step_ms_median=statistics.median(r[name] / steps * 1e3 for r in rounds),
                added_us_median=statistics.median(added_us),
            )
        )
    return rows


def run_workload(name: str, rounds: int, steps: int, seed: int, run_dir: Path) -> WorkloadResult:
    names = list(VARIANTS)
    times: list[dict[str, float]] = []
    orders: list[list[str]] = []
    for round_index in range(rounds):
        order = round_order(round_index, names)
        seconds = {
            variant: time_segment(name, VARIANTS[variant], steps, seed, run_dir)
            for variant in order
        }
        times.append(seconds)
        orders.append(order)
        print(
            f"  {name} round {round_index + 1}/{rounds}: stabmon/plain "
            f"{seconds['stabmon'] / seconds['plain']:.3f}",
            file=sys.stderr,
            flush=True,
        )
    workload = build_workload(name, seed)
    return WorkloadResult(
        name=name,
        description=workload.description,
        parameters=parameter_count(workload.model),
        steps=steps,
        rounds=times,
        orders=orders,
        rows=summarize(times, steps),
    )


# --- reporting -------------------------------------------------------------------------------


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def header(**run: object) -> dict[str, Any]:
    """The machine and versions, then the run's own settings (``run``)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "logical_cpus": psutil.cpu_count(logical=True),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "stabmon": stabmon.__version__,
        **run,
    }


def format_header(info: dict[str, Any]) -> str:
    width = max(map(len, info))
    return "\n".join(f"{key:<{width}}  {value}" for key, value in info.items())


def format_table(result: WorkloadResult) -> str:
    lines = [
        f"{result.name}: {result.description}; {result.parameters:,} parameters; "
        f"{result.steps} steps per round per variant",
        f"{'variant':<16} {'vs plain':>9} {'p10':>7} {'p90':>7} {'vs floor':>9} "
        f"{'step ms':>9} {'added us':>9}",
    ]
    for row in result.rows:
        lines.append(
            f"{row.variant:<16} {row.ratio_median:>9.3f} {row.ratio_p10:>7.3f} "
            f"{row.ratio_p90:>7.3f} {row.vs_floor_median:>9.3f} {row.step_ms_median:>9.3f} "
            f"{row.added_us_median:>9.1f}"
        )
    return "\n".join(lines)


# --- RSS mode --------------------------------------------------------------------------------


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def run_rss(steps: int, seed: int, run_dir: Path) -> dict[str, Any]:
    """Train the tiny MLP ``steps`` steps under stabmon; report RSS after warm-up and at the end."""
    workload = build_workload("tiny", seed)
    batches = batch_pool(workload, seed)
    warmup = min(1000, max(1, steps // 10))
    checkpoints: list[tuple[int, float]] = []
    with stabmon_default(workload, run_dir) as step:
        for index in range(warmup):
            step(batches[index % len(batches)])
        gc.collect()
        after_warmup = rss_mb()
        every = max(1, steps // 10)
        for index in range(steps):
            step(batches[index % len(batches)])
            if (index + 1) % every == 0:
                checkpoints.append((index + 1, rss_mb()))
        gc.collect()
        end = rss_mb()
    return {
        "steps": steps,
        "warmup_steps": warmup,
        "rss_mb_after_warmup": after_warmup,
        "rss_mb_checkpoints": checkpoints,
        "rss_mb_end": end,
        "growth_mb": end - after_warmup,
    }


def format_rss(result: dict[str, Any]) -> str:
    lines = [f"tiny + stabmon, {result['steps']} steps after {result['warmup_steps']} warm-up"]
    lines.append(f"RSS after warm-up  {result['rss_mb_after_warmup']:.1f} MB")
    lines += [f"RSS at step {step:>8}  {mb:.1f} MB" for step, mb in result["rss_mb_checkpoints"]]
    lines.append(f"RSS at end         {result['rss_mb_end']:.1f} MB")
    lines.append(f"growth             {result['growth_mb']:+.1f} MB")
    return "\n".join(lines)


# --- entry point -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds x {QUICK_STEPS} steps"
    )
    parser.add_argument("--rounds", type=int, help=f"rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument("--steps", type=int, help="steps per round (default: ~1 s of plain)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results as JSON")
    parser.add_argument(
        "--steps-rss",
        type=int,
        nargs="?",
        const=100_000,
        metavar="N",
        help="instead: N steps of tiny under stabmon, print RSS growth (default N 100000)",
    )
    args = parser.parse_args(argv)
    for key in ("rounds", "steps", "threads", "steps_rss"):
        value = getattr(args, key)
        if value is not None and value < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {value}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="stabmon-bench-") as tmp:
        run_dir = Path(tmp)
        if args.steps_rss is not None:
            report["header"] = header(rss_steps=args.steps_rss)
            print(format_header(report["header"]), flush=True)
            report["rss"] = run_rss(args.steps_rss, args.seed, run_dir)
            print()
            print(format_rss(report["rss"]))
        else:
            fixed_steps = args.steps or (QUICK_STEPS if args.quick else None)
            steps = {
                name: fixed_steps or calibrate_steps(name, args.seed, run_dir)
                for name in args.workloads
            }
            report["header"] = header(
                rounds=rounds,
                steps_per_round=", ".join(f"{name} {count}" for name, count in steps.items()),
                warmup_steps_per_variant_per_round=WARMUP_STEPS,
            )
            print(format_header(report["header"]), flush=True)
            report["workloads"] = []
            for name in args.workloads:
                result = run_workload(name, rounds, steps[name], args.seed, run_dir)
                report["workloads"].append(asdict(result))
                print()
                print(format_table(result), flush=True)
            print()
            print(
                "vs plain, p10, p90: median and 10th/90th percentiles over rounds of "
                "variant time / plain time in the same round.\nvs floor: median of "
                "variant time / floor time in the same round.\nstep ms: median step time; "
                "added us: median over rounds of (variant - plain) per step."
            )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
