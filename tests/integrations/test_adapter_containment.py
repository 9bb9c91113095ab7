"""Every adapter's own computation runs under the Monitor's guard: a batch or a loader
stabmon cannot count is counted as an internal error, and training goes on.

Lightning catches no exception raised in a callback, and neither do the Hugging Face
Trainer or Ultralytics: an error escaping an adapter stops the user's training. These
tests drive each adapter's hook methods directly with a real Monitor (no trainer needed
to raise inside the adapter) and read the result from the Monitor's registry.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stabmon import Monitor


def _samples(monitor: Monitor) -> dict[tuple[str, str], float]:
    """{(sample name, component or ""): value} read from the Monitor's registry."""
    text = generate_latest(monitor.registry).decode()
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, sample.labels.get("component", ""))] = sample.value
    return found


def _hook_errors(monitor: Monitor) -> float:
    return _samples(monitor)[("stabmon_internal_errors_total", "hooks")]


def _settings(tmp_path: Path) -> dict[str, Any]:
    return {"serve_metrics": False, "run_dir": str(tmp_path / "runs"), "run_id": "contain"}


class _LoaderWithoutLength:
    """A loader whose ``len()`` raises an error ``EpochBatches`` does not expect."""

    batch_size = 4

    def __len__(self) -> int:
        raise ValueError("this loader cannot say its length")


def _sgd_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    loss = model(torch.randn(4, 3)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def test_lightning_adapter_counts_an_uncountable_nested_tensor_batch_as_an_internal_error(
    tmp_path: Path,
) -> None:
    pytest.importorskip("pytorch_lightning")
    from stabmon.integrations.pytorch_lightning import StabmonCallback

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callback = StabmonCallback(**_settings(tmp_path))
    trainer = SimpleNamespace(optimizers=[optimizer], precision_plugin=None)
    callback.on_fit_start(trainer, model)
    try:
        (monitor,) = callback.monitors
        jagged = torch.nested.nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged)
        callback.on_train_batch_start(trainer, model, {"input_ids": jagged}, 0)  # no raise
        _sgd_step(model, optimizer)  # training goes on
        callback.on_train_batch_start(trainer, model, torch.zeros(4, 3), 1)
        samples = _samples(monitor)
        assert samples[("stabmon_internal_errors_total", "hooks")] == 1
        assert samples[("stabmon_samples_total", "")] == 4  # only the countable batch
    finally:
        callback.teardown(trainer, model, "fit")


def _huggingface(tmp_path: Path) -> tuple[Any, ...]:
    """A model, its optimizer, the Hugging Face callback and the Trainer's args/state/control."""
    transformers = pytest.importorskip("transformers")
    from stabmon.integrations.huggingface import StabmonCallback

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callback = StabmonCallback(**_settings(tmp_path))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    return model, optimizer, callback, args, state, control


def test_huggingface_callback_counts_a_loader_it_cannot_measure_as_an_internal_error(
    tmp_path: Path,
) -> None:
    model, optimizer, callback, args, state, control = _huggingface(tmp_path)
    callback.on_train_begin(
        args, state, control, model=model, optimizer=optimizer,
        train_dataloader=_LoaderWithoutLength(),
    )  # fmt: skip
    monitor = callback.monitor
    assert monitor is not None  # attached: the loader's failure did not stop training
    try:
        _sgd_step(model, optimizer)
        state.global_step = 1
        callback.on_step_end(args, state, control)
        assert _hook_errors(monitor) == 1
    finally:
        callback.on_train_end(args, state, control)


def test_huggingface_callback_counts_a_failing_throughput_count_as_an_internal_error(
    tmp_path: Path,
) -> None:
    model, optimizer, callback, args, state, control = _huggingface(tmp_path)
    callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    monitor = callback.monitor
    assert monitor is not None
    try:
        _sgd_step(model, optimizer)
        state.global_step = 1
        broken = SimpleNamespace()  # arguments the count cannot read: AttributeError inside
        callback.on_step_end(broken, state, control)  # type: ignore[arg-type]  # no raise
        assert _hook_errors(monitor) == 1
    finally:
        callback.on_train_end(args, state, control)


def test_ultralytics_callbacks_count_a_loader_they_cannot_measure_as_an_internal_error(
    tmp_path: Path,
) -> None:
    from stabmon.integrations.ultralytics import UltralyticsStabmon

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = UltralyticsStabmon(None, _settings(tmp_path))
    trainer = SimpleNamespace(
        model=model, optimizer=optimizer, scaler=None, train_loader=_LoaderWithoutLength()
    )
    session.attach(trainer)
    monitor = session.monitor
    assert monitor is not None
    try:
        for _ in range(2):
            trainer.loss = _sgd_step(model, optimizer)
            session.observe_loss(trainer)  # no raise: training goes on
        assert _hook_errors(monitor) == 2
    finally:
        monitor.detach()
