"""Goodput across restarts from event logs: hand-written logs with known answers, and a real run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tiny_model

import stabmon
from stabmon.report.events import read_run
from stabmon.report.goodput import goodput_section, rank_goodput, run_goodput
from stabmon.report.html import render


def write_log(directory: Path, records: list[dict[str, Any]], rank: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{rank}.events.jsonl"
    path.write_text("".join(json.dumps({"run": "r", "rank": rank, **r}) + "\n" for r in records))
    return directory


def totals(time: float, uptime: float, steps: int, step: int, **phases: float) -> dict[str, Any]:
    return {"time": time, "event": "throughput", "uptime_seconds": uptime, "steps": steps,
            "step": step, "phase_seconds": phases, "samples": steps * 8, "tokens": 0}  # fmt: skip


#: Two processes of one rank: the first stalls in forward and is killed; the second starts
#: 100 s later from a checkpoint 20 steps older than where the first got.
RESTARTED = [
    {"time": 1000.0, "event": "attach"},
    {"time": 1050.0, "event": "anomaly", "kind": "stall", "phase": "forward", "silent_seconds": 4},
    {"time": 1056.0, "event": "stall_end", "stalled_seconds": 6.0},
    totals(1100.0, 100.0, 100, 100, data_wait=10, forward=30, backward=30, optimizer=10, eval=5),
    {"time": 1200.0, "event": "attach"},
    {"time": 1201.0, "event": "resume", "step": 80},
    totals(1300.0, 100.0, 100, 180, data_wait=5, forward=40, backward=30, optimizer=10),
]


def test_goodput_of_a_restarted_rank_accounts_every_second_of_its_wall_time(
    tmp_path: Path,
) -> None:
    [found] = run_goodput(read_run(write_log(tmp_path / "r", RESTARTED)))

    assert found.wall_seconds == 300.0
    assert found.incarnations == 2
    assert found.spent == pytest.approx(
        {
            "training": (30 - 6 + 30 + 10) + (80 - 20 * 0.64),
            "stalled": 6.0,  # out of forward, where it stalled
            "recomputed": 20 * 0.64,  # 20 steps redone at the first process's 0.64 s a step
            "data_wait": 15.0,
            "eval": 5.0,
            "startup": 15.0 + 15.0,
            "restarts": 100.0,
        }
    )
    assert sum(found.spent.values()) == pytest.approx(found.wall_seconds)
    assert found.ratio == pytest.approx(131.2 / 300)
    assert (found.steps, found.samples) == (200, 1600)


def test_goodput_reads_a_nan_or_huge_count_as_absent(tmp_path: Path) -> None:
    hostile = {**totals(1010.0, 10.0, 0, 9, forward=5.0), "steps": "nan", "samples": 1e300}
    records = [{"time": 1000.0, "event": "attach"}, hostile]
    (found,) = run_goodput(read_run(write_log(tmp_path, records)))

    assert (found.steps, found.samples) == (0, 0)
    assert found.spent["training"] == 5.0


def test_goodput_is_none_for_a_log_without_throughput_records(tmp_path: Path) -> None:
    run = read_run(write_log(tmp_path / "r", [{"time": 1.0, "event": "attach"}]))

    assert rank_goodput(run.ranks[0]) is None
    assert "No throughput record" in goodput_section(run)


def test_goodput_section_shows_the_share_and_each_cause(tmp_path: Path) -> None:
    html = goodput_section(read_run(write_log(tmp_path / "r", RESTARTED)))

    assert "Goodput 43.7%" in html
    for cause in ("training", "data_wait", "eval", "stalled", "recomputed", "restarts"):
        assert f"<td>{cause}</td>" in html
    assert "1 restart)" in html


def test_report_of_a_real_run_shows_goodput_with_its_eval_phase(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(tmp_path), run_id="real"
    ) as monitor:
        for step in range(40):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.observe(loss=loss, samples=4)
            if step == 20:
                with monitor.phase("eval"), torch.no_grad():
                    model(torch.randn(64, 8))

    run = read_run(tmp_path / "real")
    [found] = run_goodput(run)
    assert found.steps == 40 and found.samples == 160
    assert found.spent["training"] > 0 and "eval" in found.spent
    assert sum(found.spent.values()) == pytest.approx(found.wall_seconds, rel=0.01)
    assert 'id="goodput"' in render(run)
