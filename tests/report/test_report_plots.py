"""Report details on hand-made event logs: every pid of a resumed rank, the memory plot's
extent, and a NaN sample drawn."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from stabmon.report.html import write_report


def _write(directory: Path, records: list[dict[str, Any]]) -> Path:
    run = directory / "run"
    run.mkdir()
    base = {"run": "run", "rank": 0}
    lines = [json.dumps({**base, **record}) for record in records]
    (run / "rank-0.events.jsonl").write_text("\n".join(lines) + "\n")
    return run


def _attach(pid: int, time: float) -> dict[str, Any]:
    return {"event": "attach", "time": time, "pid": pid, "environment": {"hostname": "h"},
            "config": {"leak_window_epochs": 10, "leak_warmup_epochs": 1}}  # fmt: skip


def _epoch(epoch: int, host: float) -> dict[str, Any]:
    return {"event": "epoch", "time": 100.0 + epoch, "epoch": epoch, "step": 10 * (epoch + 1),
            "memory": {"host": host}}  # fmt: skip


def test_report_lists_every_pid_of_a_resumed_rank(tmp_path: Path) -> None:
    run = _write(tmp_path, [_attach(111, 1.0), _epoch(0, 1e8), _attach(222, 50.0), _epoch(1, 1e8)])
    output = tmp_path / "report.html"
    write_report(run, output)
    assert "<td>111, 222</td>" in output.read_text()


def test_report_memory_plot_ends_at_the_last_epoch_of_a_short_run(tmp_path: Path) -> None:
    records = [_attach(111, 1.0)] + [_epoch(epoch, 1e8 + epoch * 1e6) for epoch in range(5)]
    output = tmp_path / "report.html"
    write_report(_write(tmp_path, records), output)
    page = output.read_text()  # the memory plot is the only plot of an epoch-only log
    groups = re.findall(r'<g id="xtick_\d+">(.*?)<g id="(?:xtick|matplotlib\.axis|ytick)', page,
                        re.S)  # fmt: skip
    ticks = [float(t) for g in groups for t in re.findall(r"<text[^>]*>([\d.]+)</text>", g)]
    # The x axis of a 5-epoch run stops near epoch 4, not at the open leak window's end (11).
    assert ticks and max(ticks) <= 5, ticks


def test_report_draws_a_nan_loss_sample_at_its_step(tmp_path: Path) -> None:
    records = [_attach(111, 1.0)]
    for step in range(20):
        loss: Any = "nan" if step == 12 else 1.0 / (step + 1)
        records.append({"event": "step_sample", "time": 2.0 + step, "step": step, "loss": loss,
                        "grad_norm": 1.0, "epoch": 0})  # fmt: skip
    records.append({"event": "anomaly", "time": 15.0, "kind": "nonfinite_loss", "step": 12,
                    "epoch": 0, "loss": "nan", "detail": "non-finite loss"})  # fmt: skip
    output = tmp_path / "report.html"
    write_report(_write(tmp_path, records), output)
    assert "loss not finite (NaN/Inf)" in output.read_text()
