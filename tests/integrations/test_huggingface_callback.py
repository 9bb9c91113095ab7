"""StabmonCallback in real ``transformers.Trainer.train`` runs on CPU, scraped over HTTP.

The model is a plain ``nn.Module`` returning ``{"loss": ...}`` on a synthetic
dataset: nothing is downloaded (``HF_HUB_OFFLINE=1``). One run is shared by the
tests that read it, because the Trainer's import and setup cost seconds.
"""

from __future__ import annotations

import socket
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import scrape, value
from torch.nn.utils import get_total_norm

transformers = pytest.importorskip("transformers")

from stabmon.integrations.huggingface import StabmonCallback, state_file  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

SAMPLES = 32
BATCH = 4
VOCABULARY, SEQUENCE = 16, 5


class TinyRegressor(torch.nn.Module):
    """Returns ``{"loss": ...}`` as Trainer expects; ``nan_at`` poisons one training forward."""

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
        self.nan_at = nan_at
        self.training_forwards = 0
        self.training_samples = 0  # what the Trainer fed the training forwards

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = torch.nn.functional.mse_loss(self.net(x), labels)
        if self.training and torch.is_grad_enabled():
            if self.training_forwards == self.nan_at:
                loss = loss * float("nan")
            self.training_forwards += 1
            self.training_samples += x.shape[0]
        return {"loss": loss}


class TinyTokenModel(torch.nn.Module):
    """Takes ``input_ids``, as the Trainer's token count expects; counts what it is fed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(VOCABULARY, 8)
        self.head = torch.nn.Linear(8, 1)
        self.training_samples = self.training_tokens = 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training and torch.is_grad_enabled():
            self.training_samples += input_ids.shape[0]
            self.training_tokens += input_ids.numel()
        prediction = self.head(self.embedding(input_ids).mean(dim=1))
        return {"loss": torch.nn.functional.mse_loss(prediction, labels)}


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, VOCABULARY, (size, SEQUENCE), generator=generator)
        self.y = torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.y[index]}


class Dataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 8, generator=generator)
        self.y = torch.randn(SAMPLES, 1, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


class Probe(transformers.TrainerCallback):  # type: ignore[misc]
    """References from the Trainer's own events, and a scrape before stabmon detaches."""

    def __init__(self, stabmon: StabmonCallback) -> None:
        self.stabmon = stabmon
        self.reference_norms: list[float] = []
        self.logged_losses: list[float] = []
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        self.state: dict[str, Any] = {}
        self.url = ""

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        grads = [p.grad for p in kwargs["model"].parameters() if p.grad is not None]
        self.reference_norms.append(float(get_total_norm(grads)))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.logged_losses.append(logs["loss"])

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        monitor = self.stabmon.monitor
        assert monitor is not None and monitor.metrics_url is not None
        self.url = monitor.metrics_url
        self.samples = scrape(monitor.metrics_url)
        self.state = monitor.state_dict()


@dataclass
class Run:
    trainer: Any
    model: TinyRegressor
    callback: StabmonCallback
    probe: Probe

    def metric(self, name: str, **labels: str) -> float | None:
        return value(self.probe.samples, name, **labels)


def train(
    directory: Path,
    model: Any,
    *,
    epochs: int,
    resume: bool = False,
    dataset: Any = None,
    **arguments: Any,
) -> Run:
    callback = StabmonCallback(port=0, address="127.0.0.1", run_dir=str(directory / "runs"),
                               run_id="hf-test")  # fmt: skip
    probe = Probe(callback)
    args = transformers.TrainingArguments(
        output_dir=str(directory / "out"), num_train_epochs=epochs,
        per_device_train_batch_size=BATCH, per_device_eval_batch_size=SAMPLES,
        learning_rate=0.01, logging_steps=1, report_to="none", use_cpu=True,
        disable_tqdm=True, save_strategy="epoch", eval_strategy="epoch",
        dataloader_num_workers=0, seed=0, **arguments,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=dataset or Dataset(),
        eval_dataset=dataset or Dataset(), callbacks=[probe, callback],
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=True if resume else None)
    return Run(trainer, model, callback, probe)


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """3 epochs of 8 batches, 2 batches per optimizer step, evaluated and saved each epoch."""
    return train(tmp_path_factory.mktemp("hf"), TinyRegressor(), epochs=3,
                 gradient_accumulation_steps=2)  # fmt: skip


def test_huggingface_callback_counts_optimizer_steps_under_gradient_accumulation(
    accumulated: Run,
) -> None:
    assert accumulated.trainer.state.global_step == 3 * SAMPLES // BATCH // 2
    assert accumulated.metric("stabmon_steps_total") == accumulated.trainer.state.global_step


def test_huggingface_callback_counts_the_samples_the_trainer_fed_the_model(
    accumulated: Run,
) -> None:
    assert accumulated.model.training_samples == 3 * SAMPLES  # evaluation not counted
    assert accumulated.metric("stabmon_samples_total") == accumulated.model.training_samples
    assert accumulated.metric("stabmon_tokens_total") == 0  # the Trainer counted none


def test_huggingface_callback_counts_a_short_last_batch_and_the_trainers_token_count(
    tmp_path: Path,
) -> None:
    """30 samples in batches of 4, three per step: steps of 12, 12 and 6 samples an epoch."""
    model = TinyTokenModel()
    run = train(tmp_path, model, epochs=2, dataset=TokenDataset(30),
                gradient_accumulation_steps=3, include_num_input_tokens_seen="all")  # fmt: skip
    assert run.trainer.state.global_step == 2 * 3
    assert model.training_samples == 2 * 30
    assert run.metric("stabmon_samples_total") == model.training_samples
    assert run.trainer.state.num_input_tokens_seen == model.training_tokens == 2 * 30 * SEQUENCE
    assert run.metric("stabmon_tokens_total") == model.training_tokens


def test_huggingface_callback_marks_each_epoch(accumulated: Run) -> None:
    assert accumulated.metric("stabmon_epoch") == 3


def test_huggingface_callback_grad_norm_matches_on_pre_optimizer_step(accumulated: Run) -> None:
    norms = accumulated.probe.reference_norms
    assert len(norms) == accumulated.trainer.state.global_step
    assert accumulated.metric("stabmon_grad_norm") == pytest.approx(norms[-1], rel=1e-5)


def test_huggingface_callback_observes_each_logged_training_loss(accumulated: Run) -> None:
    losses = accumulated.probe.logged_losses
    assert len(losses) == accumulated.trainer.state.global_step
    assert accumulated.metric("stabmon_loss") == pytest.approx(losses[-1])
    assert accumulated.probe.state["loss_spikes"]["count"] == len(losses)


def test_huggingface_callback_names_evaluation_and_checkpointing_as_phases(
    accumulated: Run,
) -> None:
    assert (accumulated.metric("stabmon_phase_seconds_total", phase="eval") or 0) > 0
    assert (accumulated.metric("stabmon_phase_seconds_total", phase="checkpoint") or 0) > 0


def test_huggingface_callback_saves_the_monitor_state_in_each_checkpoint(accumulated: Run) -> None:
    output = Path(accumulated.trainer.args.output_dir)
    for step in (4, 8, 12):
        saved = torch.load(state_file(output / f"checkpoint-{step}", 0), weights_only=True)
        assert saved["step"] == step


def test_huggingface_callback_detaches_at_train_end(accumulated: Run) -> None:
    assert accumulated.callback.monitor is None
    model = accumulated.model
    assert not model._forward_pre_hooks and not model._forward_hooks
    optimizer = accumulated.trainer.optimizer.optimizer  # inside Accelerate's wrapper
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    port = urllib.parse.urlsplit(accumulated.probe.url).port
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the scrape's TIME_WAIT
        probe.bind(("127.0.0.1", port or 0))  # raises if the exporter still listened


def test_huggingface_callback_counts_a_nan_loss_as_a_nonfinite_gradient_step(
    tmp_path: Path,
) -> None:
    # The last step's loss is NaN: without a GradScaler the weights turn NaN after it,
    # so a NaN any earlier would make every later step non-finite too.
    run = train(tmp_path, TinyRegressor(nan_at=SAMPLES // BATCH - 1), epochs=1)
    assert run.metric("stabmon_nonfinite_grad_steps_total") == 1
    assert run.metric("stabmon_steps_total") == SAMPLES // BATCH


def test_huggingface_callback_resume_keeps_step_numbering_and_spike_statistics(
    tmp_path: Path,
) -> None:
    steps_per_epoch = SAMPLES // BATCH
    train(tmp_path, TinyRegressor(), epochs=2)
    resumed = train(tmp_path, TinyRegressor(), epochs=4, resume=True)
    assert resumed.trainer.state.global_step == 4 * steps_per_epoch
    assert resumed.probe.state["step"] == 4 * steps_per_epoch  # numbering continued
    assert resumed.probe.state["loss_spikes"]["count"] == 4 * steps_per_epoch  # kept
    assert resumed.metric("stabmon_steps_total") == 2 * steps_per_epoch  # per process
    assert resumed.metric("stabmon_epoch") == 4
