"""add_stabmon on Ultralytics' real YOLO trainer (8.4.190, CPU), compared with what the trainer did.

Each training runs in its own process (yolo_trainee.py): Ultralytics changes process-wide
settings (logging, threads, its settings file). The trainee records the trainer's own
view (batch losses, optimizer steps counted by a step hook, epoch events) next to real
scrapes of the Monitor's endpoint; the tests compare the two, and read the run directory
after the process has gone. Offline: ``YOLO_OFFLINE=1``, ``YOLO_CONFIG_DIR`` in tmp with a
local DejaVu font as ``Arial.ttf``, a model from ``yolo11n.yaml`` and a generated data set.

Test-only shim (in yolo_trainee.py): torchvision 0.28.0's compiled ops cannot load against
the CPU build of torch 2.13.0; when they fail, the trainee gives Ultralytics a
``torchvision`` module whose ``ops.nms`` is Ultralytics' own pure-torch ``TorchNMS.nms``
(validation's NMS is all detection training takes from torchvision).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stabmon.integrations.ultralytics import state_file

pytestmark = pytest.mark.slow

TRAINEE = Path(__file__).with_name("yolo_trainee.py")
ROOT = Path(__file__).resolve().parents[2]
# Where `make` installs Ultralytics and torchvision, apart from the venv's own packages: on the
# CPU build of torch, an installed torchvision breaks every import of torchmetrics (Lightning).
ULTRALYTICS_SITE = Path(sys.prefix) / "ultralytics-site"


def run_trainee(work: Path, mode: str, epochs: int = 3) -> tuple[int, dict[str, Any]]:
    """Run one training; its exit code and what it recorded."""
    assert (ULTRALYTICS_SITE / "ultralytics").is_dir(), (
        f"Ultralytics is not installed in {ULTRALYTICS_SITE}; run `make test` (or the "
        "Makefile's `pip install --target` line) to install it there"
    )
    path = os.pathsep.join(
        filter(None, [str(ROOT), str(ULTRALYTICS_SITE), os.environ.get("PYTHONPATH")])
    )
    env = dict(os.environ, YOLO_OFFLINE="1", YOLO_CONFIG_DIR=str(work / "yolo-config"),
               PYTHONPATH=path)  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(TRAINEE), str(work), mode, str(epochs)],
        cwd=work, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    output = work / f"{mode}.json"
    assert output.exists(), f"the {mode} run recorded nothing:\n{result.stderr[-4000:]}"
    return result.returncode, json.loads(output.read_text())


def metric(samples: dict[str, float], name: str, **labels: str) -> float | None:
    key = (
        name + "{" + ",".join(f"{k}={v}" for k, v in sorted({"rank": "0", **labels}.items())) + "}"
    )
    return samples.get(key)


def run_record(work: Path) -> dict[str, Any] | None:
    path = work / "runs" / "yolo-real" / "rank-0.json"
    return json.loads(path.read_text()) if path.exists() else None


def event_log(work: Path) -> list[dict[str, Any]]:
    path = work / "runs" / "yolo-real" / "rank-0.events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ultralytics_real_training_matches_the_trainers_steps_epochs_losses_and_phases(
    tmp_path: Path,
) -> None:
    code, run = run_trainee(tmp_path, "train", epochs=3)
    assert code == 0
    final = run["final_scrape"]
    assert run["optimizer_steps"] > 3  # accumulation: fewer steps than batches
    assert metric(final, "stabmon_steps_total") == run["optimizer_steps"]
    assert metric(final, "stabmon_epoch") == 3 == len(run["train_epoch_ends"])
    assert metric(final, "stabmon_loss") == pytest.approx(run["batch_losses"][-1], rel=1e-6)
    assert run["final_state"]["loss_spikes"]["count"] == len(run["batch_losses"])  # none dropped
    # Samples: each epoch's 36 images, its last batch a short one of 4.
    assert run["training_samples"] == 3 * 36
    assert metric(final, "stabmon_samples_total") == run["training_samples"]
    assert run["batch_phases"] == [None] * len(run["batch_losses"])  # training is training
    assert (metric(final, "stabmon_phase_seconds_total", phase="eval") or 0) > 0
    assert (metric(final, "stabmon_phase_seconds_total", phase="checkpoint") or 0) > 0
    # One group per YOLO layer (model.0 ... model.23), not one `model` group for all of them.
    groups = {key for key in final if key.startswith("stabmon_module_grad_norm{")}
    assert len(groups) > 10 and "stabmon_module_grad_norm{module=model.0,rank=0}" in groups
    # Epoch records count the trainer's epochs, once each.
    assert [e["epoch"] for e in event_log(tmp_path) if e["event"] == "epoch"] == [0, 1, 2]
    assert run_record(tmp_path) is None  # a clean end deregisters


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, dict[str, Any], Any]:
    """A run that raises in epoch 2's third batch, after last.pt of epoch 1 was saved."""
    work = tmp_path_factory.mktemp("crash")
    code, run = run_trainee(work, "crash", epochs=3)
    return work, code, run, run_record(work)


def test_ultralytics_real_crash_is_recorded_as_an_exception_not_a_clean_detach(
    crashed: tuple[Path, int, dict[str, Any], Any],
) -> None:
    work, code, run, record = crashed
    assert code != 0 and run["train_epoch_ends"] == [0]
    assert record is not None, "the crash deleted the run-directory record"
    assert record["exit_status"] == "exception"
    assert not [e for e in event_log(work) if e["event"] == "detach"]


def test_ultralytics_real_resume_after_a_crash_continues_numbering_from_last_pt(
    crashed: tuple[Path, int, dict[str, Any], Any],
) -> None:
    work, _, crash, _ = crashed
    import torch

    saved = torch.load(state_file(work / "yolo" / "train" / "weights", 0), weights_only=True)
    assert saved["epoch"] == 1  # epoch 1 (index 0) was saved; the crash came in the next
    steps_of_saved_epoch = crash["batch_epochs"].count(0)
    code, resumed = run_trainee(work, "resume")
    assert code == 0 and resumed["start_epoch"] == 1
    final = resumed["final_scrape"]
    assert metric(final, "stabmon_steps_total") == resumed["optimizer_steps"]  # this process
    assert resumed["final_state"]["step"] == saved["step"] + resumed["optimizer_steps"]
    assert metric(final, "stabmon_epoch") == 3  # the trainer's epochs, the saved one included
    assert resumed["final_state"]["loss_spikes"]["count"] == (
        steps_of_saved_epoch + len(resumed["batch_losses"])
    )  # statistics kept: the saved epoch's batches and this process's
    assert run_record(work) is None


def test_ultralytics_real_nan_recovery_repeats_the_epoch_in_training_not_in_checkpoint(
    tmp_path: Path,
) -> None:
    code, run = run_trainee(tmp_path, "nan", epochs=4)
    assert code == 0 and run["nan_recovered"]
    assert run["train_epoch_ends"] == [0, 1, 1, 2, 3]  # Ultralytics repeated epoch 2 (index 1)
    final = run["final_scrape"]
    assert metric(final, "stabmon_steps_total") == run["optimizer_steps"]
    assert metric(final, "stabmon_epoch") == 4  # the repeat is the same epoch
    assert metric(final, "stabmon_samples_total") == run["training_samples"] == 5 * 36
    assert metric(final, "stabmon_nonfinite_loss_total") == 1
    assert metric(final, "stabmon_anomalies_total", kind="nonfinite_grad") == 1
    finite = [loss for loss in run["batch_losses"] if loss == loss]
    assert len(finite) == len(run["batch_losses"]) - 1
    assert run["final_state"]["loss_spikes"]["count"] == len(finite)  # the repeat's losses kept
    assert run["batch_phases"] == [None] * len(run["batch_losses"])  # the repeat is training
    assert [e["epoch"] for e in event_log(tmp_path) if e["event"] == "epoch"] == [0, 1, 2, 3]
