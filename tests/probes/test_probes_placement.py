"""stabmon.probes.placement through its own interface, on real ``cpu`` and ``meta`` tensors
(``meta`` is a real second device here: shape and dtype, no storage). Monitor-level
placement tests are in tests/probes/test_device_placement.py; this file is named after
its package because tests/daemon/test_placement.py holds the basename."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from stabmon.errors import DeviceMismatchError
from stabmon.probes.placement import (
    MAX_DEPTH,
    MAX_NAMES,
    MAX_TENSORS,
    InputCheck,
    Misplaced,
    PlacementWatch,
    model_device,
)

CPU_PARAMS = [("weight", torch.zeros(2, 2)), ("bias", torch.zeros(2))]


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


@dataclass
class Batch:
    image: torch.Tensor
    label: torch.Tensor


def test_model_device_is_the_one_device_of_the_parameters_or_none() -> None:
    assert model_device(CPU_PARAMS) == torch.device("cpu")
    assert model_device([("a", torch.zeros(1)), ("b", _meta(1))]) is None  # split
    assert model_device([("a", _meta(1))]) is None  # deferred initialisation
    assert model_device([]) is None


def test_misplaced_message_lists_a_few_names_and_counts_the_rest() -> None:
    names = tuple(f"layer{i}.weight" for i in range(MAX_NAMES + 3))
    message = Misplaced("parameters", "meta", "cpu", names).message()
    assert message.startswith("parameters on meta, expected cpu: layer0.weight, layer1.weight")
    assert message.endswith(f"layer{MAX_NAMES - 1}.weight and 3 more")
    assert Misplaced("input x", "meta", "cpu").message() == "input x on meta, expected cpu"


def test_input_check_names_tensors_inside_dicts_lists_and_dataclasses() -> None:
    check = InputCheck(CPU_PARAMS).check
    args = ({"image": _meta(2), "ok": torch.zeros(2)}, [torch.zeros(1), _meta(1)])
    found = check(args, {"batch": Batch(image=torch.zeros(1), label=_meta(1))})
    assert [f.what for f in found] == [
        "input args[0]['image']",
        "input args[1][1]",
        "input batch.label",
    ]
    assert {(f.device, f.expected) for f in found} == {("meta", "cpu")}


def test_input_check_passes_inputs_on_the_models_device_and_ignores_non_tensors() -> None:
    check = InputCheck(CPU_PARAMS).check
    assert check((torch.zeros(3), torch.zeros(3)), {}) == []
    assert check(("text", 3, None, b"raw"), {"flag": True}) == []


def test_input_check_stops_at_its_depth_and_tensor_bounds() -> None:
    check = InputCheck(CPU_PARAMS).check
    nested: Any = _meta(1)
    for _ in range(MAX_DEPTH + 1):
        nested = [nested]
    assert check((nested,), {}) == []  # deeper than MAX_DEPTH: not walked
    many = [_meta(1) for _ in range(MAX_TENSORS + 10)]
    assert len(check((many,), {})) == MAX_TENSORS


def test_input_check_does_nothing_for_a_model_on_meta() -> None:
    check = InputCheck([("weight", _meta(2))]).check
    assert check((torch.zeros(2, 5),), {}) == []


def test_placement_watch_reports_each_distinct_finding_once() -> None:
    reported: list[Misplaced] = []
    watch = PlacementWatch("warn", CPU_PARAMS, reported.append)
    for _ in range(3):
        watch.report_inputs(watch.misplaced_inputs((_meta(2),), {}))
    watch.report_inputs(watch.misplaced_inputs((torch.zeros(2), _meta(2)), {}))
    assert [f.what for f in reported] == ["input args[0]", "input args[1]"]


def test_placement_watch_in_raise_mode_raises_with_a_hint_to_move_the_input() -> None:
    watch = PlacementWatch("raise", CPU_PARAMS, lambda finding: None)
    with pytest.raises(
        DeviceMismatchError,
        match=r"input args\[0\] on meta, expected cpu; "
        r"move it with .to\('cpu'\)",
    ):
        watch.report_inputs(watch.misplaced_inputs((_meta(2),), {}))


def test_placement_watch_audit_reports_a_split_model_with_its_hint() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DeviceMismatchError, match="set device_check: off on purpose"):
        PlacementWatch("raise", list(model.named_parameters()), lambda f: None).audit(
            model, optimizer
        )
    reported: list[Misplaced] = []
    PlacementWatch("warn", list(model.named_parameters()), reported.append).audit(model, optimizer)
    assert reported and "1.weight" in reported[0].message()


def test_placement_watch_remembers_a_bounded_number_of_findings() -> None:
    reported: list[Misplaced] = []
    watch = PlacementWatch("warn", CPU_PARAMS, reported.append)
    findings = [Misplaced(f"input k{i}", "meta", "cpu") for i in range(PlacementWatch.MAX_SEEN + 5)]
    watch.report_inputs(findings)
    watch.report_inputs(findings)
    # The first MAX_SEEN are remembered; the rest, unremembered, are reported again.
    assert len(reported) == PlacementWatch.MAX_SEEN + 5 + 5
