"""The cost-at-scale benchmark runs end to end, cheaply: a few steps of small shapes."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import scaling  # noqa: E402 - bench/ is a directory of scripts, not a package


def test_scaling_model_spreads_its_tensors_over_the_module_groups() -> None:
    model = scaling.Parameters(tensors=10, groups=4)
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == 10
    assert {name.split(".")[1] for name in names} == {"g0", "g1", "g2", "g3"}


def test_stopwatch_hooks_bracket_the_hooks_registered_between_them() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    watch, order = scaling.Stopwatch(), []
    handles = scaling._bracket(model, optimizer, lambda *a: order.append("start"))
    handles.append(optimizer.register_step_pre_hook(lambda *a: order.append("inside")))
    handles += scaling._bracket(model, optimizer, lambda *a: order.append("stop"))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert order == ["start", "stop", "start", "stop", "start", "inside", "stop", "start", "stop"]
    watch.start()
    watch.stop()
    assert watch.seconds >= 0.0
    for handle in handles:
        handle.remove()


def test_scaling_measures_stabmon_and_the_floor_and_tabulates_them(tmp_path: Path) -> None:
    result = scaling.measure(tensors=20, groups=2, run_dir=tmp_path, steps=5)
    assert result.tensors == 20 and result.groups == 2 and result.steps == 5
    assert result.plain_us > 0 and result.floor_us > 0 and result.stabmon_us > 0
    assert math.isfinite(result.ratio) and result.ratio > 0
    table = scaling.format_table("title", [result])
    assert table.splitlines()[-1].startswith("| 20 | 2 | 5 | ")
