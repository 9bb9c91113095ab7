"""Lightning and Hugging Face trainers with clipping on: pre-clip norms, clip counts, and an
LR blow-up found as a gradient spike within 2 steps (clean twins raise nothing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import scrape, value
from torch.nn.utils import get_total_norm

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

BLOWUP_STEP = 40
STEPS = 60


def _anomalies(run_dir: Path) -> list[tuple[str, int]]:
    found = []
    for path in run_dir.rglob("*.events.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "anomaly":
                found.append((event["kind"], int(event["step"])))
    return sorted(found, key=lambda item: item[1])


def _regression_data(count: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(count, 8, generator=generator)
    return torch.utils.data.TensorDataset(inputs, inputs.sum(1, keepdim=True) * 0.3)


# --- Lightning ---------------------------------------------------------------------------------


def _lightning_fit(tmp_path: Path, blowup: bool) -> tuple[Any, dict[Any, float], Path]:
    pl = pytest.importorskip("pytorch_lightning")
    from stabmon.integrations.pytorch_lightning import StabmonCallback

    class Regressor(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                           torch.nn.Linear(16, 1))  # fmt: skip
            self.preclip: list[float] = []
            self.saved_lr: float | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return torch.nn.functional.mse_loss(self.net(inputs), targets)

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.preclip.append(float(get_total_norm(grads)))  # Lightning clips after this
            if blowup and self.trainer.global_step == BLOWUP_STEP:
                self.saved_lr = optimizer.param_groups[0]["lr"]
                optimizer.param_groups[0]["lr"] *= 1000.0

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.saved_lr is not None:
                self.trainer.optimizers[0].param_groups[0]["lr"] = self.saved_lr
                self.saved_lr = None

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Scrape(pl.Callback):  # type: ignore[misc, name-defined]
        def __init__(self, stabmon: Any) -> None:
            self.stabmon = stabmon
            self.samples: dict[Any, float] = {}

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            (monitor,) = self.stabmon.monitors
            monitor.state_dict()  # judges what waits: the scrape shows the last step
            self.samples = scrape(monitor.metrics_url)

    run_dir = tmp_path / "runs"
    callback = StabmonCallback(port=0, address="127.0.0.1", run_dir=str(run_dir),
                               run_id="lightning-clip", spike_warmup_steps=20)  # fmt: skip
    scraper = Scrape(callback)
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, callbacks=[scraper, callback],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path, num_sanity_val_steps=0,
        gradient_clip_val=0.5, accumulate_grad_batches=2,
    )  # fmt: skip
    module = Regressor()
    loader = torch.utils.data.DataLoader(_regression_data(64), batch_size=4)
    trainer.fit(module, loader)
    return module, scraper.samples, run_dir


def test_lightning_with_clipping_exports_the_pre_clip_norm_and_counts_clipped_steps(
    tmp_path: Path,
) -> None:
    module, samples, run_dir = _lightning_fit(tmp_path, blowup=False)
    assert len(module.preclip) == STEPS
    assert value(samples, "stabmon_grad_norm") == pytest.approx(module.preclip[-1], rel=1e-5)
    clipped = sum(norm + 1e-6 > 0.5 for norm in module.preclip)
    assert clipped > 0
    assert value(samples, "stabmon_grad_clipped_steps_total") == clipped
    assert _anomalies(run_dir) == []  # the clean twin raises nothing


def test_lightning_lr_blowup_is_a_grad_spike_within_two_steps(tmp_path: Path) -> None:
    _, _, run_dir = _lightning_fit(tmp_path, blowup=True)
    found = _anomalies(run_dir)
    spikes = [step for kind, step in found if kind in ("grad_spike", "nonfinite_grad")]
    assert spikes and BLOWUP_STEP < spikes[0] <= BLOWUP_STEP + 2, found


# --- Hugging Face ------------------------------------------------------------------------------


def _hf_train(tmp_path: Path, blowup: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    transformers = pytest.importorskip("transformers")
    from stabmon.integrations.huggingface import StabmonCallback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                           torch.nn.Linear(16, 1))  # fmt: skip

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    class Dataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self) -> None:
            self.data = _regression_data(64)

        def __len__(self) -> int:
            return 64

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            x, y = self.data[index]
            return {"x": x, "labels": y}

    class Probe(transformers.TrainerCallback):  # type: ignore[misc]
        def __init__(self, stabmon: Any) -> None:
            self.stabmon = stabmon
            self.logged_norms: list[float] = []
            self.samples: dict[Any, float] = {}
            self.saved_lr: float | None = None

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if blowup and state.global_step == BLOWUP_STEP:
                group = kw["optimizer"].param_groups[0]
                self.saved_lr, group["lr"] = group["lr"], group["lr"] * 1000.0

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.saved_lr is not None:
                kw["optimizer"].param_groups[0]["lr"] = self.saved_lr
                self.saved_lr = None

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "grad_norm" in logs:
                self.logged_norms.append(float(logs["grad_norm"]))  # clip_grad_norm_'s total

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            monitor = self.stabmon.monitor
            monitor.state_dict()
            self.samples = scrape(monitor.metrics_url)

    run_dir = tmp_path / "runs"
    callback = StabmonCallback(port=0, address="127.0.0.1", run_dir=str(run_dir),
                               run_id="hf-clip", spike_warmup_steps=20)  # fmt: skip
    probe = Probe(callback)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=0.01, lr_scheduler_type="constant",
        max_grad_norm=0.5, logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
        save_strategy="no", dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=Regressor(), args=args, train_dataset=Dataset(),
                                   callbacks=[probe, callback])  # fmt: skip
    trainer.train()
    return probe, run_dir


def test_huggingface_with_clipping_exports_the_pre_clip_norm_and_counts_clipped_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe, run_dir = _hf_train(tmp_path, False, monkeypatch)
    norms = probe.logged_norms
    assert len(norms) == STEPS
    assert value(probe.samples, "stabmon_grad_norm") == pytest.approx(norms[-1], rel=1e-5)
    clipped = sum(norm + 1e-6 > 0.5 for norm in norms)
    assert clipped > 0
    assert value(probe.samples, "stabmon_grad_clipped_steps_total") == clipped
    assert _anomalies(run_dir) == []


def test_huggingface_lr_blowup_is_a_grad_spike_within_two_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, run_dir = _hf_train(tmp_path, True, monkeypatch)
    found = _anomalies(run_dir)
    spikes = [step for kind, step in found if kind in ("grad_spike", "nonfinite_grad")]
    assert spikes and BLOWUP_STEP < spikes[0] <= BLOWUP_STEP + 2, found
