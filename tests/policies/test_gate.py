"""stabmon.policies.gate: a held-back step changes nothing, and every change is undone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stabmon.policies.gate import StepChanges, step_norm, takes_device_flag


def _stepped(optimizer_class: type[torch.optim.Optimizer], **kwargs: object) -> tuple[
    nn.Module, torch.optim.Optimizer]:  # fmt: skip
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = optimizer_class(model.parameters(), lr=0.1, **kwargs)  # type: ignore[call-arg]
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    model(torch.randn(2, 4)).sum().backward()
    return model, optimizer


def _same(a: object, b: object) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("optimizer_class", "kwargs"),
    [(torch.optim.AdamW, {}), (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1}),
     (torch.optim.Adam, {"foreach": False}), (torch.optim.RMSprop, {})],
)  # fmt: skip
def test_held_back_gradients_leave_parameters_and_state_bit_identical_and_come_back(
    optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, object]
) -> None:
    model, optimizer = _stepped(optimizer_class, **kwargs)
    before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    grads = [p.grad for p in model.parameters()]
    changes = StepChanges()

    changes.hold_gradients(optimizer)
    optimizer.step()
    changes.undo()

    after = (model.state_dict(), optimizer.state_dict())
    assert all(_same(before[0][k], after[0][k]) for k in after[0])
    for index, state in after[1]["state"].items():
        assert all(_same(before[1]["state"][index][k], v) for k, v in state.items())
    assert [p.grad for p in model.parameters()] == grads and not changes.pending


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_a_fused_optimizer_takes_the_flag_and_it_is_removed_after(
    optimizer_class: type[torch.optim.Optimizer],
) -> None:
    model, optimizer = _stepped(optimizer_class, fused=True)
    before = copy.deepcopy(model.state_dict())
    changes = StepChanges()

    assert takes_device_flag(optimizer)
    changes.pass_flag(optimizer, torch.tensor(1.0))
    optimizer.step()
    changes.undo()

    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not hasattr(optimizer, "found_inf")
    assert not takes_device_flag(torch.optim.AdamW(model.parameters()))


def test_gradscalers_flag_is_combined_with_ours_and_put_back_for_it_to_delete() -> None:
    _, optimizer = _stepped(torch.optim.AdamW, fused=True)
    theirs = torch.tensor(0.0)
    optimizer.found_inf = theirs  # type: ignore[attr-defined]  # as GradScaler sets it
    changes = StepChanges()

    changes.pass_flag(optimizer, torch.tensor(1.0))
    assert float(optimizer.found_inf) == 1.0  # type: ignore[attr-defined]
    changes.undo()

    assert optimizer.found_inf is theirs  # type: ignore[attr-defined]


def test_the_lr_is_scaled_for_the_step_and_the_loops_value_put_back() -> None:
    _, optimizer = _stepped(torch.optim.SGD)
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "lr": 0.5})
    changes = StepChanges()

    changes.scale_lr(optimizer, 0.1)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.01, 0.05])
    changes.undo()

    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.5]


def test_the_step_norm_is_the_norm_of_the_per_tensor_norms_wherever_they_are() -> None:
    on_device = step_norm(torch.tensor([3.0, 4.0]), torch.device("cpu"))
    on_host = step_norm([3.0, 4.0], torch.device("cpu"))

    assert float(on_device) == float(on_host) == 5.0
    assert not bool(torch.isfinite(step_norm([1.0, float("nan")], torch.device("cpu"))))
