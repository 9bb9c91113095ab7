"""A real Ultralytics YOLO training with add_stabmon, in its own process (test_ultralytics_real.py).

Usage: ``python yolo_trainee.py WORKDIR MODE [EPOCHS]`` with MODE one of ``train``, ``crash``
(raises in epoch 2's third batch, after ``last.pt`` of epoch 1 was saved), ``resume``
(``YOLO(last.pt).train(resume=True)``) and ``nan`` (poisons a weight before the last batch of
epoch 2, so Ultralytics' NaN recovery reloads ``last.pt`` and repeats the epoch).

What the trainer itself did is written to ``WORKDIR/<MODE>.json``, next to what stabmon
published: a real scrape of the Monitor's endpoint at every ``on_fit_epoch_end`` and at
``on_train_end``, and the Monitor's phase at each batch.

Offline: ``YOLO_OFFLINE=1`` and ``YOLO_CONFIG_DIR`` (set by the test) keep Ultralytics off
the network; a local DejaVu font stands in for the ``Arial.ttf`` it would download; the model
is built from ``yolo11n.yaml`` (no weights); the data set is generated here.

Test-only shim: torchvision 0.28.0's compiled ops do not load against the CPU build of torch
2.13.0 (``torchvision::nms`` does not exist). Ultralytics uses torchvision only for
``ops.nms`` in validation, and ships a pure-torch NMS of its own (``TorchNMS.nms``, which
"matches torchvision behavior exactly"); when torchvision's fails to load, this script puts
Ultralytics' in its place. Nothing in stabmon depends on it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
IMAGE_SIZE = 128
TRAIN_IMAGES = 36  # batches of 8, 8, 8, 8 and a short one of 4
VAL_IMAGES = 8
BATCH = 8


def prepare_offline(config_dir: Path) -> None:
    config_dir.mkdir(parents=True, exist_ok=True)
    if not (config_dir / "Arial.ttf").exists():
        shutil.copyfile(FONT, config_dir / "Arial.ttf")


def install_nms_shim() -> None:
    """A ``torchvision`` holding Ultralytics' pure-torch ``ops.nms``, if torchvision fails to load.

    Detection training imports ``torchvision`` in the validator and calls ``torchvision.ops.nms``,
    nothing else of it. A torchvision whose compiled ops cannot load raises on import and leaves
    a half-imported package behind; this replaces it by a module holding ``TorchNMS.nms``.
    """
    try:
        import torchvision

        torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
    except (ImportError, RuntimeError):
        from ultralytics.utils.nms import TorchNMS

        for name in [name for name in sys.modules if name.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        shim = types.ModuleType("torchvision")
        shim.ops = types.SimpleNamespace(nms=TorchNMS.nms)  # type: ignore[attr-defined]  # a stand-in module
        sys.modules["torchvision"] = shim


def make_dataset(root: Path) -> Path:
    """A few dozen 128 px images with one or two filled rectangles each, YOLO-format labels."""
    import cv2

    rng = np.random.default_rng(0)
    for split, count in (("train", TRAIN_IMAGES), ("val", VAL_IMAGES)):
        images, labels = root / "images" / split, root / "labels" / split
        images.mkdir(parents=True, exist_ok=True)
        labels.mkdir(parents=True, exist_ok=True)
        for index in range(count):
            image = rng.integers(0, 60, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
            lines = []
            for _ in range(int(rng.integers(1, 3))):
                cls = int(rng.integers(0, 2))
                w, h = (int(v) for v in rng.integers(20, 60, 2))
                x, y = int(rng.integers(0, IMAGE_SIZE - w)), int(rng.integers(0, IMAGE_SIZE - h))
                color = (255, 60, 60) if cls == 0 else (60, 255, 60)
                cv2.rectangle(image, (x, y), (x + w, y + h), color, thickness=-1)
                cx, cy = (x + w / 2) / IMAGE_SIZE, (y + h / 2) / IMAGE_SIZE
                lines.append(f"{cls} {cx:.6f} {cy:.6f} {w / IMAGE_SIZE:.6f} {h / IMAGE_SIZE:.6f}")
            cv2.imwrite(str(images / f"{index:03d}.png"), image)
            (labels / f"{index:03d}.txt").write_text("\n".join(lines) + "\n")
    data = root / "data.yaml"
    data.write_text(
        f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n  0: red\n  1: green\n"
    )
    return data


class Record:
    """What the trainer did, from its own callbacks (registered after stabmon's)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.batch_losses: list[float] = []
        self.batch_epochs: list[int] = []
        self.batch_phases: list[str | None] = []
        self.optimizer_steps = 0
        self._samples: list[int] = []  # images in each batch the trainer fed the model
        self.train_epoch_ends: list[int] = []
        self.fit_epoch_ends: list[int] = []
        self.epoch_scrapes: list[dict[str, Any]] = []
        self.final_scrape: dict[str, Any] = {}
        self.final_state: dict[str, Any] = {}
        self.nan_recovered = False
        self.start_epoch = 0
        self._hooked: set[int] = set()

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_train_start": self.on_train_start,
            "on_train_batch_end": self.on_train_batch_end,
            "on_train_epoch_end": lambda t: self.train_epoch_ends.append(t.epoch),
            "on_fit_epoch_end": self.on_fit_epoch_end,
            "on_train_end": self.on_train_end,
        }

    def on_train_start(self, trainer: Any) -> None:
        self.start_epoch = trainer.start_epoch
        if id(trainer.optimizer) not in self._hooked:
            self._hooked.add(id(trainer.optimizer))
            trainer.optimizer.register_step_post_hook(lambda *args: self._count_step())
            # Every training batch passes the trainer's preprocess_batch (validation has its
            # own); wrapped on the trainer, not hooked on the model, which Ultralytics pickles.
            preprocess, counted = trainer.preprocess_batch, self._samples

            def count_samples(batch: dict[str, Any]) -> Any:
                counted.append(int(batch["img"].shape[0]))
                return preprocess(batch)

            trainer.preprocess_batch = count_samples

    def _count_step(self) -> None:
        self.optimizer_steps += 1

    def on_train_batch_end(self, trainer: Any) -> None:
        self.batch_losses.append(float(trainer.loss.detach()))
        self.batch_epochs.append(trainer.epoch)
        self.batch_phases.append(self.session.phase)

    def on_fit_epoch_end(self, trainer: Any) -> None:
        self.fit_epoch_ends.append(trainer.epoch)
        if self.session.monitor is not None:
            self.epoch_scrapes.append(scrape(self.session.monitor.metrics_url))

    def on_train_end(self, trainer: Any) -> None:
        monitor = self.session.monitor
        assert monitor is not None
        self.final_scrape = scrape(monitor.metrics_url)
        self.final_state = monitor.state_dict()

    def dump(self, path: Path) -> None:
        fields = {k: v for k, v in vars(self).items() if k not in {"session", "_hooked"}}
        fields["training_samples"] = sum(self._samples)
        path.write_text(json.dumps(fields))


def scrape(url: str | None) -> dict[str, Any]:
    """The endpoint's samples as {"name{label=value,...}": value}, parsed by prometheus-client."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    assert url is not None
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "run")
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def main() -> None:
    work, mode = Path(sys.argv[1]), sys.argv[2]
    epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    prepare_offline(Path(os.environ["YOLO_CONFIG_DIR"]))
    install_nms_shim()
    from ultralytics import YOLO

    from stabmon.integrations.ultralytics import add_stabmon

    data = work / "data" / "data.yaml"
    if not data.exists():
        make_dataset(data.parent)
    weights = work / "yolo" / "train" / "weights"
    model = YOLO(str(weights / "last.pt")) if mode == "resume" else YOLO("yolo11n.yaml")
    session = add_stabmon(model, port=0, address="127.0.0.1", run_dir=str(work / "runs"),
                          run_id="yolo-real")  # fmt: skip
    record = Record(session)
    for event, callback in record.callbacks().items():
        model.add_callback(event, callback)
    batches_seen = {"epoch": -1, "count": 0}

    def fault(trainer: Any) -> None:  # on_train_batch_start
        if trainer.epoch != batches_seen["epoch"]:
            batches_seen.update(epoch=trainer.epoch, count=0)
        batches_seen["count"] += 1
        if mode == "crash" and trainer.epoch == 1 and batches_seen["count"] == 3:
            raise RuntimeError("injected crash in epoch 2")
        last_batch = len(trainer.train_loader)
        if (mode == "nan" and trainer.epoch == 1 and batches_seen["count"] == last_batch
                and not record.nan_recovered):  # fmt: skip
            record.nan_recovered = True
            with torch.no_grad():
                next(trainer.model.parameters()).view(-1)[0] = float("nan")

    model.add_callback("on_train_batch_start", fault)
    try:
        if mode == "resume":
            model.train(resume=True, workers=0)
        else:
            model.train(data=str(data), epochs=epochs, imgsz=IMAGE_SIZE, batch=BATCH,
                        nbs=2 * BATCH, workers=0, device="cpu", project=str(work / "yolo"),
                        name="train", exist_ok=True, plots=False, amp=False, seed=0,
                        deterministic=False)  # fmt: skip
    finally:
        record.dump(work / f"{mode}.json")


if __name__ == "__main__":
    main()
