"""One step numbering everywhere (docs/steps.md): a step's number is its 0-based index.

Checked through what people read: the event log's lines, ``stabmon status`` (a real scrape),
and the report's data (``read_run``, the verdict, the report page), on real small loops.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from helpers import LoopClock, events, tiny_model, train_step, wait_until
from report_helpers import stabmon_cli

import stabmon
from stabmon.config import Config
from stabmon.detectors.stall import StallReport
from stabmon.export.event_log import EventLog
from stabmon.pipeline.readings import Readings
from stabmon.pipeline.recorder import Recorder
from stabmon.report.events import read_run
from stabmon.report.verdict import judge
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter

STEPS = 23
NAN_AT = 7
EPOCH_AT = 10  # steps completed at the first epoch end


def _steps_cell(status_stdout: str) -> str:
    header, row, *after = status_stdout.splitlines()  # the table; then the NaN's provenance
    assert all(": NaN provenance, step " in line for line in after), after
    return row.split()[header.split().index("steps")]


def test_after_n_steps_and_a_detach_every_record_names_the_last_step_n_minus_1(
    tmp_path: Path,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(tmp_path), run_id="numbers",
        sample_every=5, judge_seconds=0,
    ) as monitor:  # fmt: skip
        for step in range(STEPS):
            train_step(model, optimizer, monitor, nan_grad=step == NAN_AT)
            if step + 1 == EPOCH_AT:
                monitor.epoch_end()
        monitor.epoch_end()
        status = stabmon_cli("status", "--run-dir", str(tmp_path))
        log_path = monitor.event_log_path
    assert status.returncode == 1, status.stdout + status.stderr  # the NaN: unhealthy
    assert _steps_cell(status.stdout) == str(STEPS)  # a count: stabmon_steps_total

    records = events(log_path)
    by_event: dict[str, list[int | None]] = {}
    for record in records:
        by_event.setdefault(record["event"], []).append(record.get("step"))
    last = STEPS - 1
    # The NaN was injected in loop iteration 7, the 8th step: step 7.
    anomalies = [(r["kind"], r["step"]) for r in records if r["event"] == "anomaly"]
    assert anomalies == [("nonfinite_grad", NAN_AT)]
    assert by_event["step_sample"] == [0, 5, 10, 15, 20]
    assert by_event["epoch"] == [EPOCH_AT - 1, last]  # each epoch's last step
    assert by_event["detach"] == [last]
    assert by_event["throughput"][-1] == last  # the totals written at detach

    run = read_run(tmp_path / "numbers")
    (rank,) = run.ranks
    assert (rank.last_step, rank.steps) == (last, STEPS)
    verdict = judge(run)
    assert f"{STEPS} steps on 1 rank" in verdict.headline
    assert f"at step {NAN_AT} on rank 0" in verdict.headline

    page = tmp_path / "report.html"
    result = stabmon_cli("report", str(tmp_path / "numbers"), "-o", str(page))
    assert result.returncode == 0, result.stderr
    cells = re.findall(r'<td class="num">([^<]*)</td>', page.read_text())
    assert str(last) in cells and str(NAN_AT) in cells  # last step; the anomaly table's step


def test_a_resumed_run_numbers_its_records_as_one_uninterrupted_run(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    options = dict(run_dir=str(tmp_path), run_id="resumed", sample_every=4, judge_seconds=0)
    first = stabmon.attach(model, optimizer, serve_metrics=False, **options)
    for _ in range(12):
        train_step(model, optimizer, first)
    checkpoint = first.state_dict()
    first.detach()
    assert checkpoint["step"] == 12  # the state carries a count: steps completed

    second = stabmon.attach(model, optimizer, port=0, address="127.0.0.1", **options)
    second.load_state_dict(checkpoint)
    for step in range(12, 20):
        train_step(model, optimizer, second, nan_grad=step == 15)
    status = stabmon_cli("status", "--run-dir", str(tmp_path))
    second.detach()
    assert _steps_cell(status.stdout) == "8"  # stabmon_steps_total counts this process

    records = events(second.event_log_path)
    numbered = [(r["event"], r["step"]) for r in records if r["event"] in ("detach", "resume")]
    assert numbered == [("detach", 11), ("resume", 11), ("detach", 19)]
    anomalies = [(r["kind"], r["step"]) for r in records if r["event"] == "anomaly"]
    assert anomalies == [("nonfinite_grad", 15)]  # loop iteration 15: step 15
    samples = [r["step"] for r in records if r["event"] == "step_sample"]
    assert samples == [0, 4, 8, 12, 16]  # numbering continues across the resume
    (rank,) = read_run(tmp_path / "resumed").ranks
    assert (rank.last_step, rank.steps) == (19, 20)


def test_a_detach_before_the_first_step_names_no_step(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = stabmon.attach(
        model, optimizer, serve_metrics=False, run_dir=str(tmp_path), run_id="idle"
    )
    monitor.detach()
    (detach,) = [r for r in events(monitor.event_log_path) if r["event"] == "detach"]
    assert detach["step"] is None
    run = read_run(tmp_path / "idle")
    (rank,) = run.ranks
    assert (rank.last_step, rank.steps) == (None, 0)
    assert "0 steps on 1 rank" in judge(run).headline


def test_a_stall_and_its_end_name_the_step_that_hung(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The watchdog may notice the end only after more steps completed: the end still names
    the step that hung, as the stall record and the log line do."""
    path = tmp_path / "rank-0.events.jsonl"
    readings = Readings(labels={"rank": "0", "run": "r"})
    recorder = Recorder(
        Config(),
        readings,
        events=EventLog(path, common={"run": "r", "rank": 0}, guard=Guard(LogLimiter())),
        limiter=LogLimiter(),
    )
    readings.steps = 641  # steps completed: step 641 is in progress
    recorder.stalled(
        StallReport(phase="forward", silent_seconds=9.0, limit_seconds=5.0, steps=641, stacks={})
    )
    readings.steps = 644
    with caplog.at_level(logging.INFO, logger="stabmon"):
        recorder.resumed(9.5)
    assert "step 641 completed after a stall of 9.5 s" in caplog.text
    records = [json.loads(line) for line in path.read_text().splitlines()]
    stall, end = records
    assert (stall["kind"], stall["step"], end["event"], end["step"]) == ("stall", 641, "stall_end",
                                                                          641)  # fmt: skip
    assert "step 641 hangs" in stall["detail"]
    assert end["completed"] is True


def test_a_stall_ended_by_its_phase_ending_does_not_claim_the_hung_step_completed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An evaluation longer than its phase limit stalls step 3 (3 steps done); the phase's
    end ends the stall with step 3 still in progress: the end names step 3, says it did not
    complete, and the report still says last step 2, 3 steps."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = LoopClock()
    monitor = stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(tmp_path), run_id="phase",
        stall_seconds=60, phase_stall_seconds=5, judge_seconds=0, clock=clock,
    )  # fmt: skip
    log_path = monitor.event_log_path
    try:
        for _ in range(3):
            train_step(model, optimizer, monitor)
        with caplog.at_level(logging.INFO, logger="stabmon"):
            with monitor.phase("eval"):
                clock.advance(10.0)  # past the phase limit: a stall in step 3
                wait_until(lambda: any(r.get("kind") == "stall" for r in events(log_path)),
                           "the stall is recorded")  # fmt: skip
            clock.advance(0.1)  # the phase ended: progress, but no step completed
            wait_until(lambda: any(r["event"] == "stall_end" for r in events(log_path)),
                       "the stall's end is recorded")  # fmt: skip
        status = stabmon_cli("status", "--run-dir", str(tmp_path))
    finally:
        monitor.detach()
    assert _steps_cell(status.stdout) == "3"
    records = events(log_path)
    (stall,) = [r for r in records if r.get("kind") == "stall"]
    (end,) = [r for r in records if r["event"] == "stall_end"]
    assert (stall["step"], end["step"], end["completed"]) == (3, 3, False)
    assert "step 3 completed" not in caplog.text
    assert "step 3 has not completed yet" in caplog.text
    (detach,) = [r for r in records if r["event"] == "detach"]
    assert detach["step"] == 2
    run = read_run(tmp_path / "phase")
    (rank,) = run.ranks
    assert (rank.last_step, rank.steps) == (2, 3)
    assert "3 steps on 1 rank" in judge(run).headline


def test_a_skipped_amp_iteration_has_one_index_in_its_loss_and_gradient_records(
    tmp_path: Path,
) -> None:
    # GradScaler skips iteration 40 (a NaN loss): its nonfinite_loss and its nonfinite_grad
    # records name the same step, the one still in progress (docs/steps.md: one index each).
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with stabmon.attach(model, optimizer, scaler=scaler, port=0, run_dir=str(tmp_path),
                        run_id="r", judge_seconds=0, measure_every=1) as monitor:  # fmt: skip
        for iteration in range(45):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            if iteration == 40:
                loss = loss * float("nan")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            monitor.observe(loss=loss)
    records = events(monitor.event_log_path)
    (nonfinite_loss,) = [
        r for r in records if r.get("event") == "anomaly" and r.get("kind") == "nonfinite_loss"
    ]
    skips = [r for r in records if r["event"] == "amp_skip"]
    assert [r["step"] for r in skips] == [40]
    assert nonfinite_loss["step"] == 40
