"""A real two-rank gloo DDP job under torchrun: which rank names which phase in a slowdown."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from process_groups import run_group

TRAINEE = Path(__file__).with_name("slowdown_trainee.py")


@pytest.mark.slow
def test_the_rank_with_the_slow_input_names_data_wait_and_its_peer_names_backward(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STABMON_RUN_ID": "ddp-slowdown"}
    result = run_group(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(TRAINEE), str(tmp_path)],
        env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    named: dict[int, list[str]] = {}
    for log in (tmp_path / "ddp-slowdown").glob("rank-*.events.jsonl"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "anomaly" and record.get("kind") == "slowdown":
                named.setdefault(record["rank"], []).append(record["phase"])

    # Rank 1's input pipeline slowed; rank 0 waits for it in the all-reduce inside backward.
    assert "data_wait" in named.get(1, [])
    assert "backward" in named.get(0, [])
