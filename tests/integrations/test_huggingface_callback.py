"""StabmonCallback in real ``transformers.Trainer.train`` runs on CPU, scraped over HTTP.

The model is a plain ``nn.Module`` returning ``{"loss": ...}`` on a synthetic
dataset: nothing is downloaded (``HF_HUB_OFFLINE=1``). One run is shared by the
tests that read it, because the Trainer's import and setup cost seconds. The models,
data sets and ``train`` are in ``huggingface_runs.py``, imported by the ``runs``
fixture, so collecting this file does not import transformers.
"""

from __future__ import annotations

import socket
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import torch
from helpers import events, import_on_framework

if TYPE_CHECKING:
    from huggingface_runs import Run

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def runs(offline: None) -> ModuleType:
    """``huggingface_runs``, imported by the first test here that runs (skipped without
    transformers), once ``HF_HUB_OFFLINE`` is set: the hub reads it at import."""
    return import_on_framework("transformers", "huggingface_runs")


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory, runs: ModuleType) -> Run:
    """3 epochs of 8 batches, 2 batches per optimizer step, evaluated and saved each epoch."""
    return runs.train(tmp_path_factory.mktemp("hf"), runs.TinyRegressor(), epochs=3,
                 gradient_accumulation_steps=2)  # fmt: skip


def test_huggingface_callback_counts_optimizer_steps_under_gradient_accumulation(
    accumulated: Run, runs: ModuleType
) -> None:
    assert accumulated.trainer.state.global_step == 3 * runs.SAMPLES // runs.BATCH // 2
    assert accumulated.metric("stabmon_steps_total") == accumulated.trainer.state.global_step


def test_huggingface_callback_counts_the_samples_the_trainer_fed_the_model(
    accumulated: Run, runs: ModuleType
) -> None:
    assert accumulated.model.training_samples == 3 * runs.SAMPLES  # evaluation not counted
    assert accumulated.metric("stabmon_samples_total") == accumulated.model.training_samples
    assert accumulated.metric("stabmon_tokens_total") == 0  # the Trainer counted none


def test_huggingface_callback_counts_a_short_last_batch_and_the_trainers_token_count(
    tmp_path: Path, runs: ModuleType
) -> None:
    """30 samples in batches of 4, three per step: steps of 12, 12 and 6 samples an epoch."""
    model = runs.TinyTokenModel()
    run = runs.train(tmp_path, model, epochs=2, dataset=runs.TokenDataset(30),
                gradient_accumulation_steps=3, include_num_input_tokens_seen="all")  # fmt: skip
    assert run.trainer.state.global_step == 2 * 3
    assert model.training_samples == 2 * 30
    assert run.metric("stabmon_samples_total") == model.training_samples
    assert (
        run.trainer.state.num_input_tokens_seen == model.training_tokens == 2 * 30 * runs.SEQUENCE
    )
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
    from stabmon.integrations.huggingface import state_file  # imports transformers

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
    tmp_path: Path, runs: ModuleType
) -> None:
    # The last step's loss is NaN: without a GradScaler the weights turn NaN after it,
    # so a NaN any earlier would make every later step non-finite too.
    run = runs.train(tmp_path, runs.TinyRegressor(nan_at=runs.SAMPLES // runs.BATCH - 1), epochs=1)
    assert run.metric("stabmon_nonfinite_grad_steps_total") == 1
    assert run.metric("stabmon_steps_total") == runs.SAMPLES // runs.BATCH


def test_huggingface_callback_resume_keeps_step_numbering_and_spike_statistics(
    tmp_path: Path, runs: ModuleType
) -> None:
    steps_per_epoch = runs.SAMPLES // runs.BATCH
    runs.train(tmp_path, runs.TinyRegressor(), epochs=2)
    resumed = runs.train(tmp_path, runs.TinyRegressor(), epochs=4, resume=True)
    assert resumed.trainer.state.global_step == 4 * steps_per_epoch
    assert resumed.probe.state["step"] == 4 * steps_per_epoch  # numbering continued
    assert resumed.probe.state["loss_spikes"]["count"] == 4 * steps_per_epoch  # kept
    assert resumed.metric("stabmon_steps_total") == 2 * steps_per_epoch  # per process
    assert resumed.metric("stabmon_epoch") == 4


def test_huggingface_callback_sees_a_nan_loss_the_trainers_nan_filter_hides(
    tmp_path: Path, runs: ModuleType
) -> None:
    """``logging_nan_inf_filter=True`` (the default) logs the mean of the steps before a NaN
    step (0.0 when logging each step): the loss is read from the model's output instead."""
    last = runs.SAMPLES // runs.BATCH - 1
    run = runs.train(tmp_path, runs.TinyRegressor(nan_at=last), epochs=1)
    assert run.trainer.args.logging_nan_inf_filter
    assert run.probe.logged_losses[-1] == 0.0  # what the Trainer logged for the NaN step
    assert run.metric("stabmon_nonfinite_loss_total") == 1
    records = events(tmp_path / "runs" / "hf-test" / "rank-0.events.jsonl")
    anomalies = [(r["kind"], r["step"]) for r in records if r["event"] == "anomaly"]
    assert ("nonfinite_loss", last) in anomalies


def test_huggingface_callback_exports_the_pre_clip_norm_the_trainer_logs(
    tmp_path: Path, runs: ModuleType
) -> None:
    """``max_grad_norm`` clips before ``optimizer.step()``; stabmon measures before the clip."""
    run = runs.train(tmp_path, runs.TinyRegressor(), epochs=1, max_grad_norm=1e-3)
    logged = run.probe.logged_grad_norms
    assert len(logged) == run.trainer.state.global_step and min(logged) > 1e-2  # all clipped
    assert run.metric("stabmon_grad_norm") == pytest.approx(logged[-1], rel=1e-5)
    assert run.metric("stabmon_grad_clipped_steps_total") == len(logged)


def _verdict(directory: Path) -> dict[str, object]:
    import json

    data: dict[str, object] = json.loads(
        (directory / "runs" / "hf-test" / "rank-0.verdict.json").read_text()
    )
    return data


def test_huggingface_callback_skip_keeps_a_nan_step_out_of_the_weights(
    tmp_path: Path, runs: ModuleType
) -> None:
    # A NaN loss at the 5th training forward: without the policy every weight goes NaN.
    run = runs.train(tmp_path, runs.TinyRegressor(nan_at=4), epochs=1,
                     stabmon={"on_anomaly": {"nonfinite_grad": "skip"}})  # fmt: skip

    assert all(bool(torch.isfinite(p).all()) for p in run.model.parameters())
    verdict = _verdict(tmp_path)
    assert (verdict["decision"], verdict["kind"], verdict["step"]) == (
        "continue", "nonfinite_grad", 4,
    )  # fmt: skip
    good = verdict["last_good_checkpoint"]
    assert isinstance(good, dict) and str(good["path"]).endswith("checkpoint-8")
    assert good["good"] is True and good["step"] == 7


def test_huggingface_callback_stop_raises_out_of_train_before_the_nan_step(
    tmp_path: Path, runs: ModuleType
) -> None:
    import stabmon

    model = runs.TinyRegressor(nan_at=4)
    with pytest.raises(stabmon.AnomalyStop) as raised:
        runs.train(tmp_path, model, epochs=1,
                   stabmon={"on_anomaly": {"nonfinite_grad": "stop"}})  # fmt: skip

    assert (raised.value.kind, raised.value.step) == ("nonfinite_grad", 4)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert _verdict(tmp_path)["decision"] == "stop"


def test_huggingface_callback_checkpoint_action_saves_the_weights_before_the_nan_step(
    tmp_path: Path, runs: ModuleType
) -> None:
    runs.train(tmp_path, runs.TinyRegressor(nan_at=4), epochs=1,
               stabmon={"on_anomaly": {"nonfinite_grad": "checkpoint"}})  # fmt: skip

    saved = torch.load(tmp_path / "out" / "stabmon-step4.pt", weights_only=True)
    assert saved and all(bool(torch.isfinite(v).all()) for v in saved.values())
