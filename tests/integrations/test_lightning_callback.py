"""StabmonCallback in real ``pytorch_lightning.Trainer.fit`` runs on CPU, scraped over HTTP.

Each fit is a few dozen steps of a tiny model; one fit is shared by the tests that
read it (module-scoped fixtures), because Lightning's import and setup cost seconds.
"""

from __future__ import annotations

import socket
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import scrape, value
from torch.nn.utils import get_total_norm
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("pytorch_lightning")

from stabmon.integrations.pytorch_lightning import StabmonCallback  # noqa: E402

pytestmark = [
    # Lightning's advice for real runs (worker counts, small logging intervals), and its
    # own deprecation notices, are not what these tests are about.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

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
    **trainer_args: Any,
) -> Fit:
    callback = StabmonCallback(port=0, address="127.0.0.1", run_dir=str(directory / "runs"),
                               run_id="lightning-test")  # fmt: skip
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


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> Fit:
    """3 epochs of 16 batches, 2 batches per optimizer step, bf16 autocast, with validation."""
    return fit(tmp_path_factory.mktemp("accumulated"), TinyModule(), epochs=3,
               accumulate_grad_batches=2, precision="bf16-mixed", checkpoint=True)  # fmt: skip


def test_lightning_callback_counts_optimizer_steps_under_gradient_accumulation(
    accumulated: Fit,
) -> None:
    assert accumulated.trainer.global_step == 3 * BATCHES_PER_EPOCH // 2
    assert accumulated.metric("stabmon_steps_total") == accumulated.trainer.global_step
    assert accumulated.scraper.states[0]["step"] == accumulated.trainer.global_step


def test_lightning_callback_counts_the_samples_of_every_training_batch(accumulated: Fit) -> None:
    assert accumulated.module.training_samples == 3 * 4 * BATCHES_PER_EPOCH  # not validation's
    assert accumulated.metric("stabmon_samples_total") == accumulated.module.training_samples
    assert accumulated.metric("stabmon_tokens_total") == 0  # no input_ids in these batches


def test_lightning_callback_marks_each_training_epoch(accumulated: Fit) -> None:
    assert accumulated.metric("stabmon_epoch") == 3


def test_lightning_callback_grad_norm_matches_on_before_optimizer_step(accumulated: Fit) -> None:
    assert len(accumulated.module.reference_norms) == accumulated.trainer.global_step
    assert accumulated.metric("stabmon_grad_norm") == pytest.approx(
        accumulated.module.reference_norms[-1], rel=1e-5
    )


def test_lightning_callback_observes_the_loss_of_each_optimizer_step(accumulated: Fit) -> None:
    assert accumulated.metric("stabmon_loss") == pytest.approx(
        accumulated.module.step_losses[-1], rel=1e-5
    )
    # Every step's loss reached the loss-spike statistics, each once.
    assert accumulated.scraper.states[0]["loss_spikes"]["count"] == accumulated.trainer.global_step


def test_lightning_callback_names_validation_and_checkpointing_as_phases(accumulated: Fit) -> None:
    assert (accumulated.metric("stabmon_phase_seconds_total", phase="eval") or 0) > 0
    assert (accumulated.metric("stabmon_phase_seconds_total", phase="checkpoint") or 0) > 0


def test_lightning_callback_detaches_at_teardown(accumulated: Fit) -> None:
    assert accumulated.callback.monitors == ()
    assert set(accumulated.hooks_after.values()) == {0}
    port = urllib.parse.urlsplit(accumulated.scraper.urls[0]).port
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the scrape's TIME_WAIT
        probe.bind(("127.0.0.1", port or 0))  # raises if the exporter still listened


def test_lightning_callback_counts_a_nan_loss_and_the_scaler_skip_under_16_mixed(
    tmp_path: Path,
) -> None:
    # On CPU, precision="16-mixed" turns into bf16 without a scaler: the plugin is built here.
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)  # 2**16 overflows fp16 at once
    plugin = pl.plugins.precision.MixedPrecision(precision="16-mixed", device="cpu", scaler=scaler)
    run = fit(tmp_path, TinyModule(nan_at=5), epochs=1, plugins=[plugin])
    assert run.metric("stabmon_nonfinite_grad_steps_total") == 1
    assert run.metric("stabmon_amp_skipped_steps_total") == 1
    assert run.metric("stabmon_amp_loss_scale") == 128.0  # halved once, by the skip
    assert run.metric("stabmon_steps_total") == BATCHES_PER_EPOCH


def test_lightning_callback_resume_keeps_step_numbering_and_spike_statistics(
    tmp_path: Path,
) -> None:
    first = fit(tmp_path, TinyModule(), epochs=2, checkpoint=True)
    assert first.scraper.states[0]["step"] == 2 * BATCHES_PER_EPOCH
    resumed = fit(tmp_path, TinyModule(), epochs=4, checkpoint=True,
                  ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))  # fmt: skip
    assert resumed.trainer.global_step == 4 * BATCHES_PER_EPOCH
    state = resumed.scraper.states[0]
    assert state["step"] == resumed.trainer.global_step  # numbering continued
    assert state["epoch"] == 4
    assert state["loss_spikes"]["count"] == 4 * BATCHES_PER_EPOCH  # statistics kept, not restarted
    # The counter is per process: this process took the last two epochs' steps.
    assert resumed.metric("stabmon_steps_total") == 2 * BATCHES_PER_EPOCH
    assert resumed.metric("stabmon_epoch") == 4


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


def test_lightning_callback_gives_each_optimizer_its_own_labelled_monitor(
    tmp_path: Path,
) -> None:
    run = fit(tmp_path, TwoOptimizers(), epochs=1)
    assert len(run.scraper.samples) == 2
    assert run.scraper.urls[0] != run.scraper.urls[1]
    assert run.metric("stabmon_steps_total", 0, run="lightning-test-opt0") == BATCHES_PER_EPOCH
    assert run.metric("stabmon_steps_total", 1, run="lightning-test-opt1") == BATCHES_PER_EPOCH / 2
    assert run.metric("stabmon_loss", 0) is not None
    assert {p.name for p in run.run_dir.iterdir()} == {"lightning-test-opt0", "lightning-test-opt1"}


def test_lightning_module_uses_lightning_pytorch_else_pytorch_lightning() -> None:
    from stabmon.integrations import lightning

    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:
        Callback = pl.callbacks.Callback  # noqa: N806 - the class the module falls back to
    assert issubclass(lightning.StabmonCallback, Callback)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a backward pass that takes a known least time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BACKWARD_SLEEP)
        return grad


BACKWARD_SLEEP = 0.02


class SubmoduleStepModule(TinyModule):
    """A training_step that calls its submodule, not ``self(...)``: no root forward hook fires."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(_SlowBackward.apply(self.net(inputs)), targets)


def test_lightning_callback_times_the_backward_pass_as_backward(tmp_path: Path) -> None:
    run = fit(tmp_path, SubmoduleStepModule(), epochs=1)
    # Lower bounds only (a sleep lasts at least as long as asked): every step's backward slept.
    backward = run.metric("stabmon_phase_seconds_total", phase="backward") or 0.0
    assert backward >= BATCHES_PER_EPOCH * BACKWARD_SLEEP
    assert (run.metric("stabmon_phase_seconds_total", phase="forward") or 0.0) > 0
