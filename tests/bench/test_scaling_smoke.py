"""The cost-at-scale benchmark runs end to end, cheaply: a few block pairs on small shapes."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import scaling  # noqa: E402 - bench/ is a directory of scripts, not a package


def test_scaling_model_spreads_its_tensors_over_the_module_groups() -> None:
    model = scaling.Parameters(tensors=10, groups=4)
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == 10
    assert {name.split(".")[1] for name in names} == {"g0", "g1", "g2", "g3"}


def test_scaling_measures_stabmon_against_the_floor_and_tabulates_it(tmp_path: Path) -> None:
    result = scaling.measure(tensors=20, groups=2, pairs=2, run_dir=tmp_path)
    assert result.tensors == 20 and result.groups == 2
    assert result.floor_ms > 0 and math.isfinite(result.difference_us) and result.ratio > 0
    table = scaling.format_table("title", [result])
    assert table.splitlines()[-1].startswith("| 20 | 2 | ")
