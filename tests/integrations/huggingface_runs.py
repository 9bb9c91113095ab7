"""Real ``transformers.Trainer.train`` runs for tests/integrations/test_huggingface_callback.py.

Kept apart from the tests because importing the Trainer costs seconds of CPU: the test
module imports this one in a fixture, so only the pytest worker that runs those tests pays
for it, not every worker at collection.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from helpers import scrape, value
from torch.nn.utils import get_total_norm

from stabmon.integrations.huggingface import StabmonCallback

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
        self.logged_grad_norms: list[float] = []
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        self.state: dict[str, Any] = {}
        self.url = ""

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        grads = [p.grad for p in kwargs["model"].parameters() if p.grad is not None]
        self.reference_norms.append(float(get_total_norm(grads)))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.logged_losses.append(logs["loss"])
        if logs and "grad_norm" in logs:
            self.logged_grad_norms.append(logs["grad_norm"])

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
    stabmon: dict[str, Any] | None = None,
    **arguments: Any,
) -> Run:
    callback = StabmonCallback(port=0, address="127.0.0.1", run_dir=str(directory / "runs"),
                               run_id="hf-test", **(stabmon or {}))  # fmt: skip
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
