"""Real ``pytorch_lightning.Trainer.fit`` runs for tests/integrations/test_lightning_callback.py.

Kept apart from the tests because importing Lightning costs seconds of CPU: the test
module imports this one in a fixture, so only the pytest worker that runs those tests pays
for Lightning, not every worker at collection.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from helpers import scrape, value
from torch.nn.utils import get_total_norm
from torch.utils.data import DataLoader, TensorDataset

from stabmon.integrations.pytorch_lightning import StabmonCallback

BATCHES_PER_EPOCH = 16


class TinyModule(pl.LightningModule):
    """Regression on random data; ``nan_at`` poisons the loss of one batch (global index)."""

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
        self.nan_at = nan_at
        self.reference_norms: list[float] = []
        self.step_losses: list[float] = []
        self._loss = 0.0
        self.training_samples = 0  # what Lightning fed training_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        self.training_samples += inputs.shape[0]
        loss = torch.nn.functional.mse_loss(self(inputs), targets)
        index = self.current_epoch * BATCHES_PER_EPOCH + batch_idx
        if index == self.nan_at:
            loss = loss * float("nan")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(inputs), targets))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._loss += float(outputs["loss"])  # normalized by accumulate_grad_batches
        if self.trainer.global_step > len(self.step_losses):  # an optimizer step happened
            self.step_losses.append(self._loss)
            self._loss = 0.0

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.reference_norms.append(float(get_total_norm(grads)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Scraper(pl.Callback):
    """Scrapes every monitor at ``on_fit_end``, the last hook before the callbacks' teardown."""

    def __init__(self, stabmon: StabmonCallback) -> None:
        self.stabmon = stabmon
        self.samples: list[dict[tuple[str, frozenset[tuple[str, str]]], float]] = []
        self.urls: list[str] = []
        self.states: list[dict[str, Any]] = []

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        for monitor in self.stabmon.monitors:
            assert monitor.metrics_url is not None
            self.urls.append(monitor.metrics_url)
            self.samples.append(scrape(monitor.metrics_url))
            self.states.append(monitor.state_dict())


@dataclass
class Fit:
    trainer: Any
    module: Any
    callback: StabmonCallback
    scraper: Scraper
    run_dir: Path
    hooks_after: dict[str, int] = field(default_factory=dict)

    def metric(self, name: str, index: int = 0, **labels: str) -> float | None:
        return value(self.scraper.samples[index], name, **labels)


def loaders() -> tuple[DataLoader[Any], DataLoader[Any]]:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4 * BATCHES_PER_EPOCH, 8, generator=generator),
                         torch.randn(4 * BATCHES_PER_EPOCH, 1, generator=generator))  # fmt: skip
    return DataLoader(data, batch_size=4), DataLoader(data, batch_size=32)


def fit(
    directory: Path,
    module: Any,
    *,
    epochs: int,
    ckpt_path: str | None = None,
    checkpoint: bool = False,
    stabmon: dict[str, Any] | None = None,
    **trainer_args: Any,
) -> Fit:
    callback = StabmonCallback(port=0, address="127.0.0.1", run_dir=str(directory / "runs"),
                               run_id="lightning-test", **(stabmon or {}))  # fmt: skip
    scraper = Scraper(callback)
    callbacks: list[Any] = [scraper, callback]
    if checkpoint:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=directory / "ckpt", save_last=True))
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=checkpoint,
        default_root_dir=directory, num_sanity_val_steps=0, **trainer_args,
    )  # fmt: skip
    train, validation = loaders()
    trainer.fit(module, train, validation, ckpt_path=ckpt_path)
    hooks = {
        "forward_pre": len(module._forward_pre_hooks),
        "forward": len(module._forward_hooks),
        "step_pre": len(trainer.optimizers[0]._optimizer_step_pre_hooks),
        "step_post": len(trainer.optimizers[0]._optimizer_step_post_hooks),
    }
    return Fit(trainer, module, callback, scraper, directory / "runs", hooks)


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers, as a GAN steps its generator and critic."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.first = torch.nn.Linear(8, 4)
        self.second = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        first, second = self.optimizers()
        loss = torch.nn.functional.mse_loss(self.second(self.first(inputs)), targets)
        self.manual_backward(loss)
        first.step()
        first.zero_grad()
        if batch_idx % 2 == 0:  # the second steps every other batch
            second.step()
        second.zero_grad()
        return loss.detach()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.first.parameters(), lr=0.01),
                torch.optim.SGD(self.second.parameters(), lr=0.01)]  # fmt: skip


BACKWARD_SLEEP = 0.02


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a backward pass that takes a known least time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BACKWARD_SLEEP)
        return grad


class SubmoduleStepModule(TinyModule):
    """A training_step that calls its submodule, not ``self(...)``: no root forward hook fires."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(_SlowBackward.apply(self.net(inputs)), targets)
