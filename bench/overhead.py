"""Per-step overhead of stabmon against a plain step, the floor, and what users use instead.

Each round times every variant on an identical model (same seed, same batches),
in an order rotated every two rounds and reversed every other round, so each
pair of variants runs in both orders and machine drift cancels. The figure of
merit is the median over rounds of the paired ratio variant time / plain time.
stabmon against the floor, a few percent of a step or less, is also measured
apart: both side by side in one process, taking turns in short blocks, so that
drift between segments does not drown it; the targets are judged on that. One
command also measures the RSS of a long tiny run and the exporter's cost.

Usage::

    python bench/overhead.py                  # full run: tables, 100,000-step RSS, exporter
    python bench/overhead.py --quick          # smoke test (5 rounds x 20 steps, short RSS run)
    python bench/overhead.py --update-readme  # full run, then rewrite bench/README.md results block
    python bench/overhead.py --device cuda    # GPT-2-small-sized model on CUDA, sync-checked
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from readme_block import replace_block
from variants import (
    SYNC_FREE,
    Context,
    Variant,
    floor,
    plain,
    select,
    stabmon_default,
    stabmon_judge_each,
)
from workloads import (
    CPU_WORKLOADS,
    GPU_WORKLOADS,
    WORKLOADS,
    batch_pool,
    build_workload,
    parameter_count,
)

import stabmon

# One thread: on a shared 2-core box, two OpenMP threads turned a neighbour's burst into
# 10x slower rounds; `--threads` measures other settings.
DEFAULT_THREADS = 1
DEFAULT_ROUNDS = 16  # even, so every pair of variants runs equally often in each order
WARMUP_STEPS = 5
TARGET_SECONDS = 1.0  # plain-loop time of one variant's timed segment in one round
QUICK_ROUNDS = 5
QUICK_STEPS = 20
RSS_STEPS = 100_000
QUICK_RSS_STEPS = 2_000
#: stabmon's cost is a few percent of a step or less, and a shared machine drifts by more than
#: that between one-second segments: stabmon against the floor is measured apart, in short
#: alternating blocks (tens of milliseconds each).
BLOCK_STEPS = {"tiny": 32}  # other workloads: 1 step (50-100 ms on a CPU)
BLOCK_PAIRS = {"tiny": 400}  # other workloads: 100
DEFAULT_BLOCK_PAIRS = 100
QUICK_BLOCK_PAIRS = 4
README = Path(__file__).resolve().parent / "README.md"
# Targets of issue 7, evaluated in the summary (never typed into the README by hand).
FLOOR_RATIO_TARGET = 1.05
PYTHON_US_TARGET = 30.0
RSS_MB_TARGET = 1.0


# --- timing ----------------------------------------------------------------------------------


def round_order(round_index: int, names: Sequence[str]) -> list[str]:
    """Rotate every two rounds and reverse odd rounds, so each pair meets in both orders."""
    shift = (round_index // 2) % len(names)
    order = list(names[shift:]) + list(names[:shift])
    return order[::-1] if round_index % 2 else order


def time_segment(
    workload_name: str,
    variant: Variant,
    steps: int,
    seed: int,
    context: Context,
    *,
    sync_check: bool = False,
) -> float:
    """Seconds for ``steps`` steps of ``variant`` after WARMUP_STEPS untimed steps.

    On CUDA the device is synchronised before and after the timed loop, and with
    ``sync_check`` the loop runs under ``torch.cuda.set_sync_debug_mode("error")``.
    """
    workload = build_workload(workload_name, seed)
    batches = batch_pool(workload, seed)
    cuda = workload.device.type == "cuda"
    with variant(workload, context) as step:
        for index in range(WARMUP_STEPS):
            step(batches[index % len(batches)])
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
        checked = torch.cuda.set_sync_debug_mode if cuda and sync_check else None
        if checked is not None:
            checked("error")
        try:
            start = time.perf_counter()
            for index in range(steps):
                step(batches[index % len(batches)])
        finally:
            if checked is not None:
                checked("default")
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def calibrate_steps(workload_name: str, seed: int, context: Context) -> int:
    """Steps whose plain loop takes about TARGET_SECONDS."""
    probe_steps = 10
    seconds = time_segment(workload_name, plain, probe_steps, seed, context)
    while seconds < 0.2:  # too short to trust: grow the probe
        probe_steps *= 4
        seconds = time_segment(workload_name, plain, probe_steps, seed, context)
    return max(10, round(TARGET_SECONDS * probe_steps / seconds))


def interleaved_blocks(
    workload_name: str,
    first: Variant,
    second: Variant,
    seed: int,
    context: Context,
    *,
    pairs: int,
    block_steps: int,
) -> list[tuple[float, float]]:
    """Seconds per step of ``first`` and of ``second``, one pair per pair of blocks.

    Both variants are set up side by side in this process, each on its own identical
    model, and take turns every ``block_steps`` steps, the order flipped every other
    pair. Drift slower than a pair of blocks (tens of milliseconds) cancels, where
    one-second segments seconds apart carry it whole.
    """
    with contextlib.ExitStack() as stack:
        runners = []
        for variant in (first, second):
            workload = build_workload(workload_name, seed)
            batches = batch_pool(workload, seed)
            step = stack.enter_context(variant(workload, context))
            for index in range(WARMUP_STEPS * block_steps):
                step(batches[index % len(batches)])
            runners.append((step, batches))

        def block(which: int) -> float:
            step, batches = runners[which]
            count = len(batches)
            start = time.perf_counter()
            for index in range(block_steps):
                step(batches[index % count])
            return (time.perf_counter() - start) / block_steps

        gc.collect()
        times = []
        for pair in range(pairs):
            if pair % 2:
                second_seconds, first_seconds = block(1), block(0)
            else:
                first_seconds, second_seconds = block(0), block(1)
            times.append((first_seconds, second_seconds))
    return times


def run_interleaved(name: str, pairs: int, seed: int, context: Context) -> dict[str, Any]:
    """stabmon against the floor on workload ``name``, in interleaved blocks."""
    block_steps = BLOCK_STEPS.get(name, 1)
    times = interleaved_blocks(
        name, floor, stabmon_default, seed, context, pairs=pairs, block_steps=block_steps
    )
    differences = [(ours - floors) * 1e6 for floors, ours in times]
    ratios = [ours / floors for floors, ours in times]
    return {
        "workload": name,
        "pairs": pairs,
        "block_steps": block_steps,
        "difference_us": _median_p10_p90(differences),
        "ratio": _median_p10_p90(ratios),
    }


def run_judging(pairs: int, seed: int, context: Context) -> dict[str, Any]:
    """On tiny: stabmon judging each result at once (judge_seconds 0) against the default's
    batches, in interleaved blocks: what judging in batches saves a step."""
    block_steps = BLOCK_STEPS["tiny"]
    times = interleaved_blocks(
        "tiny", stabmon_default, stabmon_judge_each, seed, context, pairs=pairs,
        block_steps=block_steps,
    )  # fmt: skip
    return {
        "workload": "tiny",
        "pairs": pairs,
        "block_steps": block_steps,
        "difference_us": _median_p10_p90([(each - batched) * 1e6 for batched, each in times]),
    }


def _median_p10_p90(values: Sequence[float]) -> dict[str, float]:
    p10, p90 = _p10_p90(values)
    return {"median": statistics.median(values), "p10": p10, "p90": p90}


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

    def row(self, variant: str) -> Row | None:
        return next((row for row in self.rows if row.variant == variant), None)


def _p10_p90(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], deciles[-1]


def summarize(rounds: Sequence[dict[str, float]], steps: int, names: Sequence[str]) -> list[Row]:
    rows = []
    for name in names:
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


def run_workload(
    name: str,
    variants: dict[str, Variant],
    rounds: int,
    steps: int,
    seed: int,
    context: Context,
) -> WorkloadResult:
    names = list(variants)
    times: list[dict[str, float]] = []
    orders: list[list[str]] = []
    for round_index in range(rounds):
        order = round_order(round_index, names)
        seconds = {
            variant: time_segment(
                name, variants[variant], steps, seed, context, sync_check=variant in SYNC_FREE
            )
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
        rows=summarize(times, steps, names),
    )


# --- RSS and exporter ------------------------------------------------------------------------


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def run_rss(steps: int, seed: int, context: Context) -> dict[str, Any]:
    """Train the tiny MLP ``steps`` steps under stabmon; report RSS after warm-up and at the end."""
    workload = build_workload("tiny", seed)
    batches = batch_pool(workload, seed)
    warmup = min(1000, max(1, steps // 10))
    checkpoints: list[tuple[int, float]] = []
    with stabmon_default(workload, context) as step:
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


def run_exporter(run_dir: Path) -> dict[str, Any]:
    """Series per rank and scrape times with 8 ranks' exporters (bench/series.py)."""
    from series import measure  # real exporters, scraped over loopback HTTP

    directory = run_dir / "series"
    directory.mkdir(exist_ok=True)
    return measure(directory)


# --- reporting -------------------------------------------------------------------------------


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def header(**run: object) -> dict[str, Any]:
    """The machine and versions, then the run's own settings (``run``)."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "logical_cpus": psutil.cpu_count(logical=True),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "stabmon": stabmon.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return {**info, **run}


def format_header(info: dict[str, Any]) -> str:
    width = max(map(len, info))
    return "\n".join(f"{key:<{width}}  {value}" for key, value in info.items())


def format_table(result: WorkloadResult) -> str:
    lines = [
        f"{result.name}: {result.description}; {result.parameters:,} parameters; "
        f"{result.steps} steps per round per variant",
        f"{'variant':<20} {'vs plain':>9} {'p10':>7} {'p90':>7} {'vs floor':>9} "
        f"{'step ms':>9} {'added us':>9}",
    ]
    for row in result.rows:
        lines.append(
            f"{row.variant:<20} {row.ratio_median:>9.3f} {row.ratio_p10:>7.3f} "
            f"{row.ratio_p90:>7.3f} {row.vs_floor_median:>9.3f} {row.step_ms_median:>9.3f} "
            f"{row.added_us_median:>9.1f}"
        )
    return "\n".join(lines)


#: --breakdown: each part of stabmon's cost as the paired difference of two variants.
BREAKDOWN_PARTS: tuple[tuple[str, str, str], ...] = (
    ("PyTorch's hook dispatch (four no-op hooks)", "torch_hooks", "plain"),
    ("stabmon's hook bodies (timing, input check, heartbeat)", "stabmon_hooks_only", "torch_hooks"),
    ("gradient measurement and host-side judgement", "stabmon_no_observe", "stabmon_hooks_only"),
    ("observe(loss)", "stabmon", "stabmon_no_observe"),
    ("for comparison, the floor's fused read", "floor", "plain"),
)


def breakdown(result: WorkloadResult) -> list[tuple[str, float]]:
    """Each part's added time per step: the median over rounds of the paired difference."""
    return [
        (part, statistics.median((r[a] - r[b]) / result.steps * 1e6 for r in result.rounds))
        for part, a, b in BREAKDOWN_PARTS
        if a in result.rounds[0] and b in result.rounds[0]
    ]


def format_breakdown(result: WorkloadResult) -> str:
    parts = breakdown(result)
    width = max(len(part) for part, _ in parts)
    lines = [f"{result.name}: where stabmon's time goes (median of paired differences, us/step)"]
    lines += [f"  {part:<{width}}  {added:>8.1f}" for part, added in parts]
    return "\n".join(lines)


def format_rss(result: dict[str, Any]) -> str:
    lines = [f"RSS: tiny + stabmon, {result['steps']} steps after {result['warmup_steps']} warm-up"]
    lines.append(f"RSS after warm-up  {result['rss_mb_after_warmup']:.1f} MB")
    lines += [f"RSS at step {step:>8}  {mb:.1f} MB" for step, mb in result["rss_mb_checkpoints"]]
    lines.append(f"RSS at end         {result['rss_mb_end']:.1f} MB")
    lines.append(f"growth             {result['growth_mb']:+.1f} MB")
    return "\n".join(lines)


def format_exporter(result: dict[str, Any]) -> str:
    rounds = result["scrape_rounds"]
    lines = [f"Exporter (real HTTP scrapes over loopback, median of {rounds}):"]
    lines += [f"series per rank, {name}: {n}" for name, n in result["series_per_rank"].items()]
    lines.append(f"one scrape of one rank: {result['scrape_ms_one_rank']:.2f} ms")
    lines.append(f"one scrape of each of 8 ranks, in turn: {result['scrape_ms_8_ranks']:.2f} ms")
    lines.append(f"series of the node daemon, 8 GPUs and 8 ranks: "
                 f"{result['series_daemon_8_gpus_8_ranks']}")  # fmt: skip
    return "\n".join(lines)


def format_interleaved(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "stabmon vs floor in interleaved blocks (side by side in one process, taking turns; "
        "median [p10, p90] over pairs)",
        f"{'workload':<10} {'pairs':>5} {'steps':>5}  {'stabmon - floor us per step':<30} "
        "stabmon / floor",
    ]
    for result in results:
        d, r = result["difference_us"], result["ratio"]
        lines.append(
            f"{result['workload']:<10} {result['pairs']:>5} {result['block_steps']:>5}  "
            f"{d['median']:>8.1f} [{d['p10']:.1f}, {d['p90']:.1f}]".ljust(43)
            + f" {r['median']:.3f} [{r['p10']:.3f}, {r['p90']:.3f}]"
        )
    return "\n".join(lines)


def format_judging(result: dict[str, Any]) -> str:
    d = result["difference_us"]
    return (
        f"tiny, judging each result at once (judge_seconds 0) - in batches (default), same "
        f"blocks, {result['pairs']} pairs: {d['median']:.1f} us per step "
        f"[{d['p10']:.1f}, {d['p90']:.1f}]"
    )


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def python_us(rounds: Sequence[dict[str, float]], steps: int) -> float:
    """stabmon's own cost per step beyond the floor: the median over rounds of the paired
    difference stabmon - floor (robust to a round slowed by a neighbour, unlike a difference
    of two medians taken against plain)."""
    return statistics.median((r["stabmon"] - r["floor"]) / steps * 1e6 for r in rounds)


def format_targets(report: dict[str, Any]) -> str:
    """Issue 7's targets, each evaluated from this run's own numbers."""
    results = {w["name"]: w for w in report.get("workloads", [])}
    interleaved = {r["workload"]: r for r in report.get("interleaved", [])}
    lines = ["Targets:"]
    for name in ("mlp17m", "convnet", "gpt2s"):
        rows = {row["variant"]: row for row in results.get(name, {}).get("rows", [])}
        if name in interleaved:
            ratio = interleaved[name]["ratio"]["median"]
            how = "in interleaved blocks"
        elif "stabmon" in rows:
            ratio, how = rows["stabmon"]["vs_floor_median"], "over rounds"
        else:
            continue
        line = (
            f"{name}: stabmon / floor {how} {ratio:.3f} (target <= {FLOOR_RATIO_TARGET}): "
            f"{_verdict(ratio <= FLOOR_RATIO_TARGET)}"
        )
        if "stabmon" in rows:
            line += (
                f"; over rounds: stabmon / floor {rows['stabmon']['vs_floor_median']:.3f}, "
                f"stabmon / plain {rows['stabmon']['ratio_median']:.3f}"
            )
        lines.append(line)
    tiny_result = results.get("tiny", {})
    tiny = {row["variant"]: row for row in tiny_result.get("rows", [])}
    if "stabmon" in tiny:
        added, floor_added = tiny["stabmon"]["added_us_median"], tiny["floor"]["added_us_median"]
        in_rounds = python_us(tiny_result["rounds"], tiny_result["steps"])
        lines.append(
            f"tiny: stabmon adds {added:.1f} us per step to a plain step; the floor (the "
            f"gradient read itself) adds {floor_added:.1f} us; stabmon - floor, the median over "
            f"rounds: {in_rounds:.1f} us"
        )
    if "tiny" in interleaved:
        own = interleaved["tiny"]["difference_us"]["median"]
        lines.append(
            f"tiny: stabmon's own Python, stabmon - floor in interleaved blocks: {own:.1f} us "
            f"(target <= {PYTHON_US_TARGET:.0f} us): {_verdict(own <= PYTHON_US_TARGET)}"
        )
    rss = report.get("rss")
    if rss is not None:
        lines.append(
            f"RSS growth over {rss['steps']} tiny steps: {rss['growth_mb']:+.1f} MB "
            f"(target < {RSS_MB_TARGET:.0f} MB): {_verdict(rss['growth_mb'] < RSS_MB_TARGET)}"
        )
    return "\n".join(lines)


LEGEND = (
    "vs plain, p10, p90: median and 10th/90th percentiles over rounds of variant time / plain "
    "time in the same round.\nvs floor: median of variant time / floor time in the same round."
    "\nstep ms: median step time; added us: median over rounds of (variant - plain) per step."
)


# --- entry point -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds x {QUICK_STEPS} steps"
    )
    parser.add_argument("--rounds", type=int, help=f"rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument("--steps", type=int, help="steps per round (default: ~1 s of plain)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS))
    parser.add_argument(
        "--no-peers", action="store_true", help="leave out Lightning's grad_norm and wandb.watch"
    )
    parser.add_argument(
        "--breakdown", action="store_true",
        help="add variants that split stabmon's cost into hook dispatch, hook bodies, gradient "
        "measurement and observe(), and print each part",
    )  # fmt: skip
    parser.add_argument(
        "--steps-rss", type=int, metavar="N",
        help=f"steps of the RSS run (default {RSS_STEPS}, {QUICK_RSS_STEPS} with --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--block-pairs", type=int, metavar="N",
        help="pairs of interleaved stabmon and floor blocks per workload (default "
        f"{BLOCK_PAIRS['tiny']} on tiny, {DEFAULT_BLOCK_PAIRS} on the others, "
        f"{QUICK_BLOCK_PAIRS} with --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--skip-interleaved", action="store_true", help="no interleaved stabmon vs floor run"
    )
    parser.add_argument("--skip-rss", action="store_true", help="no RSS run")
    parser.add_argument("--skip-exporter", action="store_true", help="no exporter measurement")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results as JSON")
    parser.add_argument(
        "--update-readme", type=Path, nargs="?", const=README, metavar="PATH",
        help="rewrite the block between <!-- bench:overhead --> markers (default bench/README.md)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for key in ("rounds", "steps", "threads", "steps_rss", "block_pairs"):
        value = getattr(args, key)
        if value is not None and value < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {value}")
    allowed = GPU_WORKLOADS if args.device == "cuda" else CPU_WORKLOADS
    args.workloads = args.workloads or list(allowed)
    wrong = [name for name in args.workloads if name not in allowed]
    if wrong:
        parser.error(f"--device {args.device} runs {', '.join(allowed)}; got {', '.join(wrong)}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available here")
        args.skip_rss = args.skip_exporter = True  # both are CPU measurements
    return args


def run(args: argparse.Namespace, command: str) -> tuple[dict[str, Any], str]:
    """Run the benchmark; return the report and its text, as printed."""
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    variants, left_out = select(peers=not args.no_peers, breakdown=args.breakdown)
    report: dict[str, Any] = {"command": command}
    out: list[str] = []

    def emit(text: str) -> None:
        out.append(text)
        print(text, flush=True)

    with tempfile.TemporaryDirectory(prefix="stabmon-bench-") as tmp:
        context = Context(Path(tmp))
        try:
            fixed_steps = args.steps or (QUICK_STEPS if args.quick else None)
            steps = {
                name: fixed_steps or calibrate_steps(name, args.seed, context)
                for name in args.workloads
            }
            report["header"] = header(
                rounds=rounds,
                steps_per_round=", ".join(f"{name} {count}" for name, count in steps.items()),
                warmup_steps_per_variant_per_round=WARMUP_STEPS,
                variants_left_out="; ".join(f"{k}: {v}" for k, v in left_out.items()) or "none",
            )
            emit(format_header(report["header"]))
            report["workloads"] = []
            for name in args.workloads:
                result = run_workload(name, variants, rounds, steps[name], args.seed, context)
                report["workloads"].append(asdict(result))
                emit("\n" + format_table(result))
                if args.breakdown:
                    emit("\n" + format_breakdown(result))
            emit("\n" + LEGEND)
            if not args.skip_interleaved and args.device == "cpu":
                report["interleaved"] = []
                for name in args.workloads:
                    pairs = args.block_pairs or (
                        QUICK_BLOCK_PAIRS
                        if args.quick
                        else BLOCK_PAIRS.get(name, DEFAULT_BLOCK_PAIRS)
                    )
                    print(f"  {name}: {pairs} interleaved block pairs", file=sys.stderr, flush=True)
                    report["interleaved"].append(run_interleaved(name, pairs, args.seed, context))
                emit("\n" + format_interleaved(report["interleaved"]))
                if "tiny" in args.workloads:
                    pairs = args.block_pairs or (
                        QUICK_BLOCK_PAIRS if args.quick else BLOCK_PAIRS["tiny"]
                    )
                    print(f"  tiny: {pairs} judging block pairs", file=sys.stderr, flush=True)
                    report["judging"] = run_judging(pairs, args.seed, context)
                    emit(format_judging(report["judging"]))
            if not args.skip_rss:
                rss_steps = args.steps_rss or (QUICK_RSS_STEPS if args.quick else RSS_STEPS)
                print(f"  RSS run: {rss_steps} tiny steps", file=sys.stderr, flush=True)
                report["rss"] = run_rss(rss_steps, args.seed, context)
                emit("\n" + format_rss(report["rss"]))
            if not args.skip_exporter:
                print("  exporter: 8 ranks and a daemon", file=sys.stderr, flush=True)
                report["exporter"] = run_exporter(Path(tmp))
                emit("\n" + format_exporter(report["exporter"]))
            emit("\n" + format_targets(report))
        finally:
            context.close()
    return report, "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    arguments = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join([".venv/bin/python", "bench/overhead.py", *arguments])
    report, text = run(args, command)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    if args.update_readme is not None:
        info = report["header"]
        intro = (
            f"Measured on {info['date'][:10]} with `{command}` on {info['cpu_model']} "
            f"({info['logical_cpus']} logical CPUs, {info['torch_threads']} torch thread(s), "
            f"torch {info['torch']}), output as printed:"
        )
        replace_block(args.update_readme, f"{intro}\n\n```text\n{text}\n```")
        print(f"\nupdated the results block in {args.update_readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
