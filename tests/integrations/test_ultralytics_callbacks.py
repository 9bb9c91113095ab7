"""add_stabmon on a stand-in of Ultralytics' trainer (ultralytics_standin.py), scraped over HTTP.

The stand-in follows Ultralytics' callback protocol and attribute names, and reaches paths a
CPU run of the real trainer cannot (a GradScaler that skips); test_ultralytics_real.py runs
the adapter on the real trainer.
"""

from __future__ import annotations

import socket
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import scrape, value
from ultralytics_standin import StandInTrainer, StandInYOLO

from stabmon.integrations.ultralytics import UltralyticsStabmon, add_stabmon, state_file


@dataclass
class Run:
    trainer: StandInTrainer
    session: UltralyticsStabmon
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    url: str = ""

    def metric(self, name: str, **labels: str) -> float | None:
        return value(self.samples, name, **labels)


def train(directory: Path, stabmon: dict[str, Any] | None = None, **overrides: Any) -> Run:
    """A YOLO-style run with add_stabmon, scraped at on_train_end (before teardown detaches)."""
    model = StandInYOLO()
    session = add_stabmon(model, port=0, address="127.0.0.1", run_dir=str(directory / "runs"),
                          run_id="yolo-test", **(stabmon or {}))  # fmt: skip
    run = Run(trainer=None, session=session)  # type: ignore[arg-type]

    def scrape_at_train_end(trainer: Any) -> None:
        monitor = session.monitor
        assert monitor is not None and monitor.metrics_url is not None
        run.url = monitor.metrics_url
        run.samples = scrape(monitor.metrics_url)
        run.state = monitor.state_dict()

    model.add_callback("on_train_end", scrape_at_train_end)
    run.trainer = model.train(directory / "yolo", **overrides)
    return run


def test_ultralytics_callbacks_count_steps_epochs_and_the_loss(tmp_path: Path) -> None:
    run = train(tmp_path, epochs=3, batches=8, accumulate=2)
    assert run.metric("stabmon_steps_total") == 3 * 8 // 2
    assert run.metric("stabmon_epoch") == 3
    assert run.metric("stabmon_loss") == pytest.approx(run.trainer.batch_losses[-1], rel=1e-6)
    assert run.state["loss_spikes"]["count"] == 3 * 8  # trainer.loss of every batch


def test_ultralytics_callbacks_grad_norm_matches_the_trainers_clip_grad_norm(
    tmp_path: Path,
) -> None:
    run = train(tmp_path, epochs=1)
    assert run.metric("stabmon_grad_norm") == pytest.approx(run.trainer.clip_norms[-1], rel=1e-5)


def test_ultralytics_callbacks_name_validation_and_saving_as_phases(tmp_path: Path) -> None:
    run = train(tmp_path, epochs=2)
    assert (run.metric("stabmon_phase_seconds_total", phase="eval") or 0) > 0
    assert (run.metric("stabmon_phase_seconds_total", phase="checkpoint") or 0) > 0


def test_ultralytics_callbacks_count_a_nan_gradient_step(tmp_path: Path) -> None:
    # In the last step: without AMP the weights turn NaN after it, and every later step with them.
    run = train(tmp_path, epochs=1, batches=8, accumulate=2, nan_at=7)
    assert run.metric("stabmon_nonfinite_grad_steps_total") == 1
    assert run.metric("stabmon_nonfinite_loss_total") == 1


def test_ultralytics_callbacks_count_the_amp_skip_of_a_nan_loss(tmp_path: Path) -> None:
    run = train(tmp_path, epochs=1, batches=8, accumulate=2, amp=True, nan_at=3)
    assert run.metric("stabmon_amp_skipped_steps_total") == 1  # trainer.scaler was wired
    assert run.metric("stabmon_amp_loss_scale") == 128.0  # 256 halved once
    assert run.metric("stabmon_nonfinite_loss_total") == 1


def test_ultralytics_callbacks_resume_from_the_weights_folder_keeps_numbering(
    tmp_path: Path,
) -> None:
    train(tmp_path, epochs=2, batches=8, accumulate=2)
    saved = torch.load(state_file(tmp_path / "yolo" / "weights", 0), weights_only=True)
    assert saved["step"] == 8
    resumed = train(tmp_path, epochs=4, batches=8, accumulate=2, resume=True)
    assert resumed.state["step"] == 16  # numbering continued
    assert resumed.state["loss_spikes"]["count"] == 4 * 8  # statistics kept
    assert resumed.metric("stabmon_steps_total") == 8  # per process
    assert resumed.metric("stabmon_epoch") == 4


def test_ultralytics_callbacks_detach_at_teardown(tmp_path: Path) -> None:
    run = train(tmp_path, epochs=1)
    assert run.session.monitor is None
    assert not run.trainer.model._forward_pre_hooks and not run.trainer.model._forward_hooks
    assert not run.trainer.optimizer._optimizer_step_pre_hooks
    assert "update" not in vars(run.trainer.scaler)  # the disabled scaler was never wrapped
    port = urllib.parse.urlsplit(run.url).port
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the scrape's TIME_WAIT
        probe.bind(("127.0.0.1", port or 0))  # raises if the exporter still listened


def test_ultralytics_add_stabmon_registers_on_a_trainer_too(tmp_path: Path) -> None:
    trainer = StandInTrainer(tmp_path / "yolo", epochs=1)
    session = add_stabmon(trainer, port=0, address="127.0.0.1", run_dir=str(tmp_path / "runs"))
    steps: list[float | None] = []

    def read_steps(trainer: Any) -> None:
        assert session.monitor is not None
        steps.append(value(scrape(session.monitor.metrics_url), "stabmon_steps_total"))

    trainer.add_callback("on_train_end", read_steps)
    trainer.train()
    assert steps == [4]
    assert session.monitor is None


def test_ultralytics_callbacks_skip_keeps_a_nan_step_out_and_record_last_pt_as_good(
    tmp_path: Path,
) -> None:
    import json

    run = train(tmp_path, {"on_anomaly": {"nonfinite_grad": "skip"}}, epochs=2, batches=8,
                accumulate=2, nan_at=5)  # fmt: skip

    assert all(bool(torch.isfinite(p).all()) for p in run.trainer.model.parameters())
    verdict = json.loads((tmp_path / "runs" / "yolo-test" / "rank-0.verdict.json").read_text())
    assert (verdict["kind"], verdict["decision"]) == ("nonfinite_grad", "continue")
    good = verdict["last_good_checkpoint"]
    assert good["path"] == str(run.trainer.last) and good["good"] is True and good["size"] > 0


def test_ultralytics_callbacks_stop_raises_out_of_train(tmp_path: Path) -> None:
    import stabmon

    with pytest.raises(stabmon.AnomalyStop) as raised:
        train(tmp_path, {"on_anomaly": {"nonfinite_grad": "stop"}}, epochs=1, batches=8,
              accumulate=2, nan_at=5)  # fmt: skip

    assert raised.value.kind == "nonfinite_grad"
