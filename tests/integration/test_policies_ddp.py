"""on_anomaly across real ranks: four gloo DDP ranks under torchrun on CPU, a gradient
spike on rank 1 only (written after DDP's all-reduce, so no other rank sees it).

Without the agreement rank 1 would skip or stop alone and its replica would part from
the others; with it every rank acts at the same step (stabmon.policies.agreement).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

TRAINEE = Path(__file__).parent / "policies_trainee.py"
RANKS = 4


def _run(tmp_path: Path, *args: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the job; each rank's result and verdict."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "STABMON_DIR": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1",
           "STABMON_RUN_ID": "policies"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={RANKS}", str(TRAINEE), "--out", str(out), *args],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(RANKS)]
    verdicts = [
        json.loads((tmp_path / "runs" / "policies" / f"rank-{r}.verdict.json").read_text())
        for r in range(RANKS)
    ]
    return results, verdicts


def test_a_spike_on_rank_1_only_is_skipped_by_all_four_ranks_which_stay_bit_identical(
    tmp_path: Path,
) -> None:
    # Fused AdamW: the agreed flag gates the step on the device (found_inf), no host read.
    results, verdicts = _run(tmp_path, "--action", "skip", "--fused")

    assert [result["unchanged"] for result in results] == [[30]] * RANKS
    assert len({result["params"] for result in results}) == 1
    assert [(v["decision"], v["kind"], v["step"]) for v in verdicts] == [
        ("continue", "grad_spike", 30)
    ] * RANKS


def test_stop_raises_on_all_four_ranks_at_the_same_step(tmp_path: Path) -> None:
    results, verdicts = _run(tmp_path, "--action", "stop")

    assert [result["stopped"] for result in results] == [
        {"kind": "grad_spike", "step": 30, "rank": rank, "anomaly_step": 30, "at_iteration": 30}
        for rank in range(RANKS)
    ]
    assert len({result["params"] for result in results}) == 1
    assert [v["decision"] for v in verdicts] == ["stop"] * RANKS


def test_a_policy_attached_on_rank_0_alone_turns_itself_off_instead_of_hanging(
    tmp_path: Path,
) -> None:
    # A loop that monitors rank 0 only: its per-step agreement would wait for ranks that
    # never issue one (or pair with DDP's all-reduce). It counts the ranks with a policy in
    # the store at the first step, finds 1 of 4, says so and stays out of the collectives.
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "STABMON_DIR": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1",
           "STABMON_RUN_ID": "policies"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={RANKS}", str(TRAINEE), "--out", str(out), "--action", "stop",
         "--only-rank", "0", "--steps", "20", "--spike-step", "1000"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    log = tmp_path / "runs" / "policies" / "rank-0.events.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    (off,) = [r for r in records if r.get("event") == "on_anomaly"]
    assert off["state"] == "off" and "only some ranks" in off["reason"]
