"""bench/gpu_gpt.py's code paths, run on the CPU with a tiny GPT so that the one run a borrowed
GPU machine gets does not die of a typo: the figures themselves are only meaningful on CUDA
(``make gpu-check`` runs the script there)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_gpt  # noqa: E402 - bench/ is a directory of scripts, not a package

TINY = gpu_gpt.Shape("tiny", layers=2, width=32, heads=2, vocab=64, context=16, batch=2,
                     steps_per_block=3)  # fmt: skip


def test_exported_flops_per_step_match_the_flop_counter_and_the_palm_formula(
    tmp_path: Path,
) -> None:
    result = gpu_gpt.measure_mfu(tmp_path, TINY, device="cpu", seconds=0.5)

    assert result["internal_errors"] == 0
    # The flash backward's recompute of QK^T is counted; the formula leaves it out.
    assert result["exported_over_palm"] == pytest.approx(1.0, rel=0.05)
    # Stock FlopCounterMode does not know the CPU flash-attention kernel (stabmon registers
    # it): on the CPU stabmon counts more than it; on CUDA the two agree (gpu_gpt checks).
    assert result["exported_over_counter"] > 1.0
    assert result["mfu_exported"] is None  # no peak FLOP/s for a CPU: no MFU, said so


def test_overhead_blocks_alternate_and_report_a_ratio_per_pair(tmp_path: Path) -> None:
    row = gpu_gpt.measure_overhead(TINY, compiled=False, blocks=2, run_dir=tmp_path, device="cpu")

    assert row["blocks"] == 2 and row["internal_errors"] == 0
    assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
    assert row["plain_ms_per_step"] > 0 and row["stabmon_ms_per_step"] > 0


def test_a_replica_checks_cost_is_measured_against_the_steps_between_two_checks() -> None:
    result = gpu_gpt.measure_replica_check(TINY, device="cpu", checks=2)

    assert result["module_groups"] >= 2 and result["parameters"] > 0
    assert result["check_ms"] > 0 and result["share_of_steps_at_every"] > 0
