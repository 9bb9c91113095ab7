"""stabmon.probes.provenance on real loops: after a non-finite value, the module that
produced it (forward or backward) is named, the ones that only passed it on are told apart,
and a transient is "not reproduced" with the step to look at. Read through the event log."""

from __future__ import annotations

from typing import Any

import torch
from conftest import MonitorFactory
from helpers import events
from torch import nn

from stabmon.probes.provenance import INPUT, forward_producer


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.poisoned = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        if self.poisoned:
            y = torch.log(y * 0.0)  # log of zero: -inf, then NaN downstream
        return y


class _Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Layer() for _ in range(12))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * 0.5 + x * 0.5
        out: torch.Tensor = self.head(x)
        return out


def _train(model: nn.Module, monitor: object, optimizer: torch.optim.Optimizer,
           scaler: torch.amp.GradScaler, steps: int, *, poison_from: int | None = None,
           batch_nan_at: int | None = None) -> None:  # fmt: skip
    """An AMP-style loop: GradScaler skips a step whose gradients are not finite, so the
    weights stay finite and the fault can be watched again."""
    for step in range(steps):
        if poison_from is not None and step == poison_from:
            model.layers[7].poisoned = True  # type: ignore[union-attr, index]
        inputs = torch.randn(4, 8)
        if step == batch_nan_at:
            inputs[0, 0] = float("nan")  # one bad sample in one batch, healthy weights
        loss = model(inputs).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        monitor.observe(loss=loss)  # type: ignore[attr-defined]


def _attached(attach: MonitorFactory, **overrides: object) -> tuple[_Deep, object, Any, Any]:
    model = _Deep()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = attach(model, optimizer, scaler=scaler, judge_seconds=0, **overrides)
    return model, monitor, optimizer, scaler


def _provenance(monitor: object, kind: str = "provenance") -> list[dict[str, object]]:
    monitor.detach()  # type: ignore[attr-defined]
    records = events(monitor.event_log_path)  # type: ignore[attr-defined]
    return [r for r in records if r["event"] == kind or r.get("kind") == kind]


def _first_nonfinite_step(monitor: object) -> object:
    records = events(monitor.event_log_path)  # type: ignore[attr-defined]
    return next(r["step"] for r in records if r.get("kind") == "nonfinite_loss")


def test_a_log_of_zero_in_layer_7_is_produced_there_in_the_forward_and_passed_on_after(
    attach: MonitorFactory,
) -> None:
    model, monitor, optimizer, scaler = _attached(attach)
    _train(model, monitor, optimizer, scaler, 46, poison_from=40)
    (record,) = _provenance(monitor)
    assert record["producer"] == "layers.7"
    assert record["direction"] == "forward"
    assert record["step"] == _first_nonfinite_step(monitor)  # what the anomaly said
    assert record["observed_step"] == 40 and record["reproduced"] is True
    assert record["propagators"] and all(
        str(name).startswith(("layers.8", "layers.9", "layers.10", "layers.11", "head"))
        for name in record["propagators"]  # type: ignore[attr-defined]
    )


class _Frozen(torch.optim.SGD):
    """An optimizer whose step changes nothing: the weights stay finite whatever the grads."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.0)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


class _NanGrad(torch.autograd.Function):
    """Identity forward; a NaN gradient backward (a broken custom kernel)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class _BrokenBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 8)
        self.middle = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.middle(self.stem(x))
        out: torch.Tensor = self.head(_NanGrad.apply(x))
        return out


def test_a_nan_gradient_from_a_custom_function_is_placed_in_the_backward_pass(
    attach: MonitorFactory,
) -> None:
    model = _BrokenBackward()
    optimizer = _Frozen(model.parameters())  # steps (its hooks run) but applies nothing
    monitor = attach(model, optimizer, judge_seconds=0)
    for _ in range(5):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    (record,) = _provenance(monitor)
    assert record["direction"] == "backward"
    assert record["producer"] == "middle"  # the last module, in model order, gone non-finite


def test_a_nan_in_one_batch_with_healthy_weights_is_not_reproduced_with_its_step(
    attach: MonitorFactory,
) -> None:
    model, monitor, optimizer, scaler = _attached(attach)
    _train(model, monitor, optimizer, scaler, 30, batch_nan_at=20)
    (record,) = _provenance(monitor)
    assert record["producer"] is None and record["reproduced"] is False
    assert record["step"] == _first_nonfinite_step(monitor)
    assert record["watched_steps"] == [21, 22, 23]  # the steps after the bad batch


def test_always_mode_names_a_bad_batch_as_the_input_at_its_own_step(
    attach: MonitorFactory,
) -> None:
    model, monitor, optimizer, scaler = _attached(attach, provenance_always=True)
    _train(model, monitor, optimizer, scaler, 25, batch_nan_at=20)
    records = _provenance(monitor)
    assert [(r["observed_step"], r["producer"]) for r in records] == [(20, INPUT)]


def test_forward_producer_tells_the_producer_from_its_containers_and_propagators() -> None:
    names = ["layers.6", "layers.7.linear", "layers.7", "layers.8", "head", ""]
    flags = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0]  # (inputs finite, output finite) per call
    assert forward_producer(names, [float(f) for f in flags]) == ("layers.7", ["layers.8", "head"])
    assert forward_producer(names[:1], [1.0, 1.0]) == (None, [])


def test_a_watched_model_compiled_with_fullgraph_still_trains(attach: MonitorFactory) -> None:
    # The watch arms after a NaN; under torch.compile its hooks are constant no-ops, so a
    # fullgraph compile neither breaks nor errors (a compiled forward is not watched).
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0, provenance_always=True)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    for step in range(4):
        inputs = torch.randn(4, 8)
        if step == 1:
            inputs[0, 0] = float("nan")
        loss = compiled(inputs).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)
    assert _provenance(monitor) == []  # not watched under compile, and nothing broke
