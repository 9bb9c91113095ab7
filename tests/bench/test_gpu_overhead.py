"""On CUDA: a GPT-2-small-sized model trains a few hundred monitored steps without a sync.

The benchmark's ``--device cuda`` mode runs stabmon's variants under
``torch.cuda.set_sync_debug_mode("error")``; a synchronisation inside stabmon is
contained and counted, and the benchmark refuses a segment with any contained
error. Skipped with "Requires: CUDA" elsewhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import overhead  # noqa: E402 - bench/ is a directory of scripts, not a package

pytestmark = pytest.mark.gpu


def test_gpt2_small_overhead_is_measured_without_synchronisation(tmp_path: Path) -> None:
    output = tmp_path / "gpu.json"
    # 4 rounds x 50 steps: 200 timed steps per stabmon variant, each under sync-debug "error".
    argv = ["--device", "cuda", "--rounds", "4", "--steps", "50", "--no-peers",
            "--json", str(output)]  # fmt: skip
    assert overhead.main(argv) == 0
    (gpt,) = json.loads(output.read_text())["workloads"]
    rows = {row["variant"]: row for row in gpt["rows"]}
    print(f"stabmon / plain on {gpt['description']}: {rows['stabmon']['ratio_median']:.4f}")
    assert rows["stabmon"]["ratio_median"] < 1.10  # generous here; the README reports the figure
