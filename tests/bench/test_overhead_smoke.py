"""The overhead benchmark runs end to end, cheaply: 2 rounds x a few steps of each variant."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import instructions  # noqa: E402 - bench/ is a directory of scripts, not a package
import overhead  # noqa: E402
from readme_block import BEGIN, END, replace_block  # noqa: E402
from variants import BREAKDOWN, CORE, Context  # noqa: E402


@pytest.fixture(autouse=True)
def frozen_heap() -> Iterator[None]:
    """Leave the suite's objects out of the benchmark's ``gc.collect()`` calls.

    bench/overhead.py collects garbage before each timed segment so that no
    collection lands inside it. In its own process that is cheap; in the test
    process it walks every object the tests before it left behind, tens of times
    per test (most of these tests' time). ``gc.freeze()`` moves the objects that
    exist now out of the collector's sight; what the benchmark makes is collected
    as usual, and ``unfreeze()`` hands the rest back afterwards.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_overhead_benchmark_reports_every_variant_with_finite_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{BEGIN}\nold numbers\n{END}\n\nafter\n")
    output = tmp_path / "out.json"
    argv = ["--rounds", "2", "--steps", "3", "--workloads", "tiny", "--no-peers",
            "--steps-rss", "20", "--skip-exporter", "--block-pairs", "2", "--json", str(output),
            "--update-readme", str(readme)]  # fmt: skip
    assert overhead.main(argv) == 0

    report = json.loads(output.read_text())
    assert {"torch", "torch_threads", "cpu_model", "logical_cpus"} <= set(report["header"])
    (tiny,) = report["workloads"]
    rows = {row["variant"]: row for row in tiny["rows"]}
    assert set(rows) == set(CORE)
    assert all(math.isfinite(row["ratio_median"]) and row["ratio_median"] > 0
               for row in rows.values())  # fmt: skip
    assert len(tiny["rounds"]) == 2 and report["rss"]["steps"] == 20
    (interleaved,) = report["interleaved"]
    assert interleaved["pairs"] == 2 and interleaved["block_steps"] == overhead.BLOCK_STEPS["tiny"]
    assert (
        math.isfinite(interleaved["difference_us"]["median"]) and interleaved["ratio"]["median"] > 0
    )
    judging = report["judging"]
    assert judging["pairs"] == 2 and math.isfinite(judging["difference_us"]["median"])
    printed = capsys.readouterr().out
    assert "stabmon_every10" in printed and "Targets:" in printed
    assert "judging each result at once (judge_seconds 0) - in batches" in printed
    text = readme.read_text()
    assert "old numbers" not in text and text.endswith(f"{END}\n\nafter\n")
    assert report["command"] in text and "stabmon_every10" in text


def test_breakdown_runs_its_variants_and_prints_each_part(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--rounds", "2", "--steps", "3", "--workloads", "tiny", "--no-peers",
            "--skip-rss", "--skip-exporter", "--skip-interleaved", "--breakdown"]  # fmt: skip
    assert overhead.main(argv) == 0
    printed = capsys.readouterr().out
    for name in BREAKDOWN:
        assert f"\n{name} " in printed
    for part, _, _ in overhead.BREAKDOWN_PARTS:
        assert re.search(rf"^  {re.escape(part)} +-?\d+\.\d$", printed, re.MULTILINE), part


def test_breakdown_parts_are_median_paired_differences_per_step() -> None:
    # Three rounds of 1,000 steps; seconds chosen so each part's per-round difference is known.
    rounds = [
        {"plain": 1.000, "floor": 1.040, "torch_hooks": 1.010, "stabmon_hooks_only": 1.030,
         "stabmon_no_observe": 1.080, "stabmon": 1.090},
        {"plain": 2.000, "floor": 2.050, "torch_hooks": 2.008, "stabmon_hooks_only": 2.028,
         "stabmon_no_observe": 2.068, "stabmon": 2.076},
        {"plain": 1.500, "floor": 1.545, "torch_hooks": 1.512, "stabmon_hooks_only": 1.530,
         "stabmon_no_observe": 1.590, "stabmon": 1.600},
    ]  # fmt: skip
    result = overhead.WorkloadResult(
        name="tiny", description="", parameters=0, steps=1_000, rounds=rounds, orders=[], rows=[]
    )
    parts = dict(overhead.breakdown(result))
    expected = {"torch_hooks": 10.0, "stabmon_hooks_only": 20.0, "stabmon_no_observe": 50.0,
                "stabmon": 10.0, "floor": 45.0}  # fmt: skip
    for part, variant, _ in overhead.BREAKDOWN_PARTS:
        assert parts[part] == pytest.approx(expected[variant]), part


def test_python_us_is_the_median_paired_difference_and_ignores_one_slowed_round() -> None:
    # 1,000 steps per round: stabmon - floor is 20, 25 and 30 us; the third round's plain and
    # floor segments were slowed by a neighbour, which a difference of medians would not cancel.
    rounds = [
        {"plain": 1.000, "floor": 1.050, "stabmon": 1.070},
        {"plain": 1.000, "floor": 1.040, "stabmon": 1.065},
        {"plain": 3.000, "floor": 3.100, "stabmon": 3.130},
    ]
    assert overhead.python_us(rounds, 1_000) == pytest.approx(25.0)
    report = {"workloads": [{"name": "tiny", "rounds": rounds, "steps": 1_000, "rows": [
        {"variant": "stabmon", "added_us_median": 70.0},
        {"variant": "floor", "added_us_median": 50.0},
    ]}], "interleaved": [
        {"workload": "tiny", "difference_us": {"median": 31.5}, "ratio": {"median": 1.07}},
        {"workload": "convnet", "difference_us": {"median": 40.0}, "ratio": {"median": 1.001}},
    ]}  # fmt: skip
    targets = overhead.format_targets(report)
    assert "stabmon - floor, the median over rounds: 25.0 us" in targets
    assert "in interleaved blocks: 31.5 us (target <= 30 us): NOT met" in targets
    assert "convnet: stabmon / floor in interleaved blocks 1.001 (target <= 1.05): met" in targets


class _FakeClock:
    """``perf_counter`` for the benchmark's timing: advanced only by the steps below."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@contextlib.contextmanager
def _ticking(
    clock: _FakeClock, step_us: float, workload: object, context: object
) -> Iterator[Callable[..., None]]:
    """A step that takes exactly ``step_us`` on the fake clock."""

    def step(batch: object) -> None:
        clock.now += step_us / 1e6

    yield step


def test_interleaved_blocks_time_each_variant_per_step_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fake clock, not wall time: the test must pass on a busy machine (figures are bench's).
    clock = _FakeClock()
    monkeypatch.setattr(overhead, "time", clock)
    slow = functools.partial(_ticking, clock, 400.0)
    fast = functools.partial(_ticking, clock, 100.0)
    times = overhead.interleaved_blocks(
        "tiny", fast, slow, 0, Context(tmp_path), pairs=6, block_steps=4
    )
    # Per step, first variant then second, in every pair whichever block ran first.
    assert times == [(pytest.approx(100e-6), pytest.approx(400e-6))] * 6


def test_instruction_count_refuses_an_unknown_variant_naming_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert instructions.main(["stabmon", "no_such_variant"]) == 2
    printed = capsys.readouterr().out
    assert "unknown variant(s) no_such_variant" in printed
    assert "stabmon_hooks_only" in printed  # the breakdown's variants can be counted too


def test_readme_block_is_refused_without_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    with pytest.raises(ValueError, match="expected the markers"):
        replace_block(readme, "numbers")
    assert readme.read_text() == "no markers here\n"


def test_overhead_benchmark_refuses_cuda_without_a_device(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if overhead.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit):
        overhead.parse_args(["--device", "cuda"])
    assert "no CUDA device" in capsys.readouterr().err
