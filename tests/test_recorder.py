"""stabmon.recorder.Recorder through its own interface: host values in; readings, event
records and log lines out. No Monitor, no torch: numbers go in as the read-back would
deliver them, and the real event log is read back from tmp_path."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from stabmon.config import load_config
from stabmon.detectors.dead import DeadReport
from stabmon.errors import StabmonError
from stabmon.export.event_log import EventLog
from stabmon.guard import Guard
from stabmon.log import LogLimiter
from stabmon.probes.grads import GradLayout, GradSummary
from stabmon.readings import Readings
from stabmon.recorder import Recorder

LAYOUT = GradLayout(
    ("encoder", "head"),
    (0, 1),
    None,
    None,
    names=("encoder.weight", "head.weight"),
    model_order=(0, 1),
    empty_shards=(),
)


class Harness:
    """A Recorder on a real event log in tmp_path, with small warm-ups."""

    def __init__(self, tmp_path: Path, **overrides: Any) -> None:
        settings: dict[str, Any] = {"spike_warmup_steps": 5, "spike_episode_gap": 3}
        settings.update(overrides)
        self.config = load_config({}, overrides=settings, env={})
        self.readings = Readings(labels={"rank": "0", "run": "r"})
        self.path = tmp_path / "rank-0.events.jsonl"
        events = EventLog(self.path, common={"run": "r", "rank": 0}, guard=Guard(LogLimiter()))
        self.recorder = Recorder(self.config, self.readings, events=events, limiter=LogLimiter())

    def records(self, event: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        found = [json.loads(line) for line in self.path.read_text().splitlines()]
        return [r for r in found if event is None or r["event"] == event]

    def anomalies(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records("anomaly") if r["kind"] == kind]

    def grads(self, step: int, encoder: float, head: float = 1.0) -> None:
        total = (encoder**2 + head**2) ** 0.5
        summary = GradSummary(
            total, 0, total != total or total == float("inf"), [encoder, head], LAYOUT
        )
        self.recorder.grads(step, summary, lambda s: ["encoder.weight"])


@pytest.fixture
def harness(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


def test_recorder_records_one_anomaly_per_nonfinite_gradient_episode_and_counts_every_step(
    harness: Harness,
) -> None:
    for step in range(3):
        harness.grads(step, 1.0)
    for step in range(3, 7):
        harness.grads(step, float("nan"))
    (anomaly,) = harness.anomalies("nonfinite_grad")
    assert (anomaly["step"], anomaly["modules"], anomaly["parameters"]) == (
        3,
        ["encoder"],
        ["encoder.weight"],
    )
    assert harness.readings.nonfinite_grad_steps == 4
    assert harness.readings.anomalies["nonfinite_grad"] == 1


def test_recorder_ends_a_nonfinite_gradient_episode_after_the_gap_of_finite_steps(
    harness: Harness,
) -> None:
    harness.grads(0, float("inf"))
    harness.grads(1, float("inf"))
    for step in range(2, 6):
        harness.grads(step, 1.0)
    (end,) = harness.records("nonfinite_grad_end")
    assert (end["first_step"], end["last_step"], end["count"], end["modules"]) == (
        0,
        1,
        2,
        ["encoder"],
    )


def test_recorder_closes_an_open_nonfinite_loss_episode_at_flush(harness: Harness) -> None:
    harness.recorder.loss(0, 1.0)
    harness.recorder.loss(1, float("nan"))
    harness.recorder.loss(2, float("nan"))
    assert harness.records("nonfinite_loss_end") == []
    harness.recorder.flush_sample()
    (end,) = harness.records("nonfinite_loss_end")
    assert (end["first_step"], end["last_step"], end["count"]) == (1, 2, 2)
    assert harness.readings.nonfinite_losses == 2
    assert len(harness.anomalies("nonfinite_loss")) == 1


def test_recorder_calls_a_loss_ten_times_its_mean_a_spike_at_once(harness: Harness) -> None:
    for step in range(20):
        harness.recorder.loss(step, 1.0 + 0.01 * (step % 3))
    harness.recorder.loss(20, 50.0)
    (spike,) = harness.anomalies("loss_spike")
    assert (spike["step"], spike["loss"], spike["first_step"]) == (20, 50.0, 20)
    assert harness.readings.loss == 50.0


def test_recorder_waits_for_the_next_loss_before_calling_a_moderate_rise_a_spike(
    harness: Harness,
) -> None:
    for step in range(20):
        harness.recorder.loss(step, 1.0 + 0.01 * (step % 3))
    harness.recorder.loss(20, 3.0)  # a hard batch, or the start of a rise
    assert harness.anomalies("loss_spike") == []
    harness.recorder.loss(21, 3.0)  # still up: an incident, recorded at its first step
    (spike,) = harness.anomalies("loss_spike")
    assert (spike["step"], spike["first_step"]) == (20, 20)


def test_recorder_forgets_a_moderate_loss_rise_that_falls_back_at_once(harness: Harness) -> None:
    for step in range(20):
        harness.recorder.loss(step, 1.0 + 0.01 * (step % 3))
    harness.recorder.loss(20, 3.0)
    harness.recorder.loss(21, 1.0)
    assert harness.anomalies("loss_spike") == []


@pytest.mark.parametrize("clip_first", [True, False])
def test_recorder_computes_the_clip_coefficient_whichever_of_clip_and_norm_comes_first(
    harness: Harness, clip_first: bool
) -> None:
    if clip_first:
        harness.recorder.clip(0, 1.0)
    harness.grads(0, 3.0, 4.0)  # total 5
    if not clip_first:
        harness.recorder.clip(0, 1.0)
    assert harness.readings.grad_clip_coefficient == pytest.approx(0.2)
    assert harness.readings.grad_clipped_steps == 1


def test_recorder_reports_coefficient_one_for_a_step_the_clip_left_alone(harness: Harness) -> None:
    harness.recorder.clip(0, 10.0)
    harness.grads(0, 3.0, 4.0)
    harness.grads(1, 3.0, 4.0)  # no clip call in step 1
    assert harness.readings.grad_clip_coefficient == 1.0
    assert harness.readings.grad_clipped_steps == 0


def test_recorder_counts_each_scale_drop_as_a_skipped_step_and_raises_one_anomaly_per_run(
    tmp_path: Path,
) -> None:
    harness = Harness(tmp_path, amp_skip_run=3)
    scale = 65536.0
    harness.recorder.scale(0, scale)
    for step in range(1, 6):
        scale /= 2
        harness.recorder.scale(step, scale)
    assert harness.readings.amp_skipped_steps == 5
    assert harness.readings.amp_loss_scale == scale
    assert [r["consecutive"] for r in harness.records("amp_skip")] == [1, 2, 3, 4, 5]
    (anomaly,) = harness.anomalies("nonfinite_grad")
    assert (anomaly["source"], anomaly["step"]) == ("amp_skip_run", 3)


def test_recorder_reports_a_leak_once_when_epoch_memory_keeps_growing(tmp_path: Path) -> None:
    harness = Harness(
        tmp_path,
        leak_rule="epoch_windows",
        leak_window_epochs=1,
        leak_windows=2,
        leak_warmup_epochs=0,
        leak_threshold=0.03,
    )
    memory = 100e6
    for _ in range(8):
        harness.readings.steps += 10
        harness.recorder.epoch({"cuda:0": memory}, {"cuda:0": memory})
        memory *= 1.10
    (leak,) = harness.anomalies("memory_leak")
    assert leak["device"] == "cuda:0"
    assert harness.readings.memory_leak_suspected == {"cuda:0": 1}
    epochs = harness.records("epoch")
    assert [r["epoch"] for r in epochs] == list(range(8))
    assert [r["step"] for r in epochs] == [9, 19, 29, 39, 49, 59, 69, 79]
    assert harness.readings.epoch == 8


def test_recorder_reports_no_leak_while_epoch_memory_stays_flat(tmp_path: Path) -> None:
    harness = Harness(
        tmp_path,
        leak_rule="epoch_windows",
        leak_window_epochs=1,
        leak_windows=2,
        leak_warmup_epochs=0,
    )
    for _ in range(8):
        harness.recorder.epoch({"cuda:0": 100e6}, {"cuda:0": 100e6})
    assert harness.anomalies("memory_leak") == []
    assert harness.readings.memory_leak_suspected == {"cuda:0": 0}


def test_recorder_raises_one_dead_gradient_anomaly_per_newly_dead_group(harness: Harness) -> None:
    report = DeadReport(newly_dead=("encoder.0.weight",), revived=())
    harness.recorder.dead(100, report, {"encoder": 1, "head": 0})
    harness.recorder.dead(101, DeadReport(("encoder.1.weight",), ()), {"encoder": 2, "head": 0})
    (anomaly,) = harness.anomalies("dead_grad")
    assert anomaly["modules"] == ["encoder"]
    assert [r["modules"] for r in harness.records("dead_gradients")] == [
        ["encoder.0"],
        ["encoder.1"],
    ]
    assert harness.readings.dead_grad_params == {"encoder": 2, "head": 0}


def test_recorder_writes_a_worker_death_with_its_signal_and_warns_once(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    harness.readings.steps = 12
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        harness.recorder.worker_died({"worker": 1, "pid": 4242, "signal": 9, "exitcode": None})
    (record,) = harness.records("loader_worker_died")
    assert (record["step"], record["pid"], record["signal"]) == (12, 4242, 9)
    assert "died with signal 9 at step 12" in caplog.text


def test_recorder_state_round_trip_continues_step_numbering_in_a_new_process(
    tmp_path: Path,
) -> None:
    first = Harness(tmp_path / "a")
    first.readings.steps = 40
    first.readings.epoch = 3
    state = first.recorder.state_dict()
    second = Harness(tmp_path / "b")
    second.readings.steps = 3  # steps this process took before the checkpoint was loaded
    second.recorder.load_state_dict(state)
    assert (second.recorder.global_step, second.recorder.last_step) == (40, 39)
    assert second.readings.epoch == 3
    (resume,) = second.records("resume")
    assert (resume["step"], resume["epoch"]) == (39, 3)
    second.readings.steps = 5  # two more steps
    assert second.recorder.last_step == 41


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 1}, "version 2"),
        ({"step": -1}, "expected integers >= 0"),
        ({"epoch": True}, "expected integers >= 0"),
        ({"leaks": {"cuda:0": {"bogus": 1}}}, "malformed"),
    ],
)
def test_recorder_rejects_a_bad_state_and_changes_nothing(
    harness: Harness, change: dict[str, Any], message: str
) -> None:
    state = {**harness.recorder.state_dict(), **change}
    harness.readings.steps = 5
    with pytest.raises(StabmonError, match=message):
        harness.recorder.load_state_dict(state)
    assert (harness.recorder.global_step, harness.readings.epoch) == (5, 0)
    assert harness.records("resume") == []


def test_recorder_names_missing_state_keys(harness: Harness) -> None:
    state = harness.recorder.state_dict()
    del state["leaks"], state["epoch"]
    with pytest.raises(StabmonError, match="missing key\\(s\\) epoch, leaks"):
        harness.recorder.load_state_dict(state)


def test_recorder_without_an_event_log_still_counts_anomalies(tmp_path: Path) -> None:
    readings = Readings(labels={})
    recorder = Recorder(load_config({}, env={}), readings, events=None, limiter=LogLimiter())
    recorder.anomaly("stall", 3, "no step completed")
    assert readings.anomalies["stall"] == 1
