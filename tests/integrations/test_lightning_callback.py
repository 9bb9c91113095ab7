"""StabmonCallback in real ``pytorch_lightning.Trainer.fit`` runs on CPU, scraped over HTTP.

Each fit is a few dozen steps of a tiny model; one fit is shared by the tests that
read it (module-scoped fixtures), because Lightning's import and setup cost seconds.
The modules, callbacks and ``fit`` are in ``lightning_fits.py``, imported by the
``fits`` fixture, so collecting this file does not import Lightning.
"""

from __future__ import annotations

import socket
import urllib.parse
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import torch
from helpers import import_on_framework

if TYPE_CHECKING:
    from lightning_fits import Fit

pytestmark = [
    # Lightning's advice for real runs (worker counts, small logging intervals), and its
    # own deprecation notices, are not what these tests are about.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def fits() -> ModuleType:
    """``lightning_fits``, imported by the first test here that runs (skipped without Lightning)."""
    return import_on_framework("pytorch_lightning", "lightning_fits")


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory, fits: ModuleType) -> Fit:
    """3 epochs of 16 batches, 2 batches per optimizer step, bf16 autocast, with validation."""
    return fits.fit(tmp_path_factory.mktemp("accumulated"), fits.TinyModule(), epochs=3,
               accumulate_grad_batches=2, precision="bf16-mixed", checkpoint=True)  # fmt: skip


def test_lightning_callback_counts_optimizer_steps_under_gradient_accumulation(
    accumulated: Fit, fits: ModuleType
) -> None:
    assert accumulated.trainer.global_step == 3 * fits.BATCHES_PER_EPOCH // 2
    assert accumulated.metric("stabmon_steps_total") == accumulated.trainer.global_step
    assert accumulated.scraper.states[0]["step"] == accumulated.trainer.global_step


def test_lightning_callback_counts_the_samples_of_every_training_batch(
    accumulated: Fit, fits: ModuleType
) -> None:
    # What training_step was fed, not validation_step.
    assert accumulated.module.training_samples == 3 * 4 * fits.BATCHES_PER_EPOCH
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
    tmp_path: Path, fits: ModuleType
) -> None:
    # On CPU, precision="16-mixed" turns into bf16 without a scaler: the plugin is built here.
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)  # 2**16 overflows fp16 at once
    plugin = fits.pl.plugins.precision.MixedPrecision(
        precision="16-mixed", device="cpu", scaler=scaler
    )
    run = fits.fit(tmp_path, fits.TinyModule(nan_at=5), epochs=1, plugins=[plugin])
    assert run.metric("stabmon_nonfinite_grad_steps_total") == 1
    assert run.metric("stabmon_amp_skipped_steps_total") == 1
    assert run.metric("stabmon_amp_loss_scale") == 128.0  # halved once, by the skip
    assert run.metric("stabmon_steps_total") == fits.BATCHES_PER_EPOCH


def test_lightning_callback_resume_keeps_step_numbering_and_spike_statistics(
    tmp_path: Path, fits: ModuleType
) -> None:
    first = fits.fit(tmp_path, fits.TinyModule(), epochs=2, checkpoint=True)
    assert first.scraper.states[0]["step"] == 2 * fits.BATCHES_PER_EPOCH
    resumed = fits.fit(tmp_path, fits.TinyModule(), epochs=4, checkpoint=True,
                  ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))  # fmt: skip
    assert resumed.trainer.global_step == 4 * fits.BATCHES_PER_EPOCH
    state = resumed.scraper.states[0]
    assert state["step"] == resumed.trainer.global_step  # numbering continued
    assert state["epoch"] == 4
    # The spike statistics were kept, not restarted.
    assert state["loss_spikes"]["count"] == 4 * fits.BATCHES_PER_EPOCH
    # The counter is per process: this process took the last two epochs' steps.
    assert resumed.metric("stabmon_steps_total") == 2 * fits.BATCHES_PER_EPOCH
    assert resumed.metric("stabmon_epoch") == 4


def test_lightning_callback_gives_each_optimizer_its_own_labelled_monitor(
    tmp_path: Path, fits: ModuleType
) -> None:
    run = fits.fit(tmp_path, fits.TwoOptimizers(), epochs=1)
    assert len(run.scraper.samples) == 2
    assert run.scraper.urls[0] != run.scraper.urls[1]
    batches = fits.BATCHES_PER_EPOCH
    assert run.metric("stabmon_steps_total", 0, run="lightning-test-opt0") == batches
    assert run.metric("stabmon_steps_total", 1, run="lightning-test-opt1") == batches / 2
    assert run.metric("stabmon_loss", 0) is not None
    assert {p.name for p in run.run_dir.iterdir()} == {"lightning-test-opt0", "lightning-test-opt1"}


def test_lightning_module_uses_lightning_pytorch_else_pytorch_lightning(fits: ModuleType) -> None:
    from stabmon.integrations import lightning

    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:
        Callback = fits.pl.callbacks.Callback  # noqa: N806 - the class the module falls back to
    assert issubclass(lightning.StabmonCallback, Callback)


def test_lightning_callback_times_the_backward_pass_as_backward(
    tmp_path: Path, fits: ModuleType
) -> None:
    run = fits.fit(tmp_path, fits.SubmoduleStepModule(), epochs=1)
    # Lower bounds only (a sleep lasts at least as long as asked): every step's backward slept.
    backward = run.metric("stabmon_phase_seconds_total", phase="backward") or 0.0
    assert backward >= fits.BATCHES_PER_EPOCH * fits.BACKWARD_SLEEP
    assert (run.metric("stabmon_phase_seconds_total", phase="forward") or 0.0) > 0


def test_lightning_callback_skip_keeps_a_nan_step_out_of_the_weights(
    tmp_path: Path, fits: ModuleType
) -> None:
    # The Monitor gates its stand-in step; the callback then holds Lightning's own step back.
    module = fits.TinyModule(nan_at=5)
    run = fits.fit(tmp_path, module, epochs=1,
                   stabmon={"on_anomaly": {"nonfinite_grad": "skip"}})  # fmt: skip

    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    assert run.trainer.global_step == fits.BATCHES_PER_EPOCH  # the loop went on


def test_lightning_callback_stop_raises_out_of_fit_before_the_nan_step(
    tmp_path: Path, fits: ModuleType
) -> None:
    import stabmon

    module = fits.TinyModule(nan_at=5)
    with pytest.raises(stabmon.AnomalyStop) as raised:
        fits.fit(tmp_path, module, epochs=1, stabmon={"on_anomaly": {"nonfinite_grad": "stop"}})

    assert (raised.value.kind, raised.value.step) == ("nonfinite_grad", 5)
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_lightning_callback_checkpoint_action_saves_with_the_trainer_before_the_nan_step(
    tmp_path: Path, fits: ModuleType
) -> None:
    module = fits.TinyModule(nan_at=5)
    fits.fit(tmp_path, module, epochs=1, stabmon={"on_anomaly": {"nonfinite_grad": "checkpoint"}})

    saved = torch.load(tmp_path / "stabmon-step5.ckpt", weights_only=False)
    assert all(bool(torch.isfinite(v).all()) for v in saved["state_dict"].values())
