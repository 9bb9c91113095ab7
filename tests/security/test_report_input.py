"""Issue 21, item 8: ``stabmon report`` on an event log holding anything at all."""

from __future__ import annotations

from pathlib import Path

import torch

from stabmon.cli import main
from stabmon.report.events import read_log
from tests.helpers import tiny_model, train_step

_HOSTILE_LINES = [
    b'{"time": 1795400000.0, "event": "anomaly", "kind": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"time": ' + b"9" * 400 + b', "event": "anomaly", "kind": "stall", "step": 3}',
    b'{"time": 1795400000.0, "event": "anomaly", "kind": {"a": 1}, "step": 3}',
    b'{"time": 1795400000.0, "event": "step_sample", "step": "three"}',
    b'{"time": 1795400000.0, "event": ["anomaly"], "step": 3}',
    b'{"time": 1795400000.0, "event": "epoch", "epoch": ' + b"1" * 5000 + b"}",
]


def test_report_skips_and_counts_malformed_lines_and_still_renders(
    attach, tmp_path: Path, capsys
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, run_dir=str(tmp_path / "runs"), run_id="hostile",
                     sample_every=2)  # fmt: skip
    for _ in range(6):
        train_step(model, optimizer, monitor)
    log_path = monitor.event_log_path
    monitor.detach()
    assert log_path is not None
    with log_path.open("ab") as log:
        for line in _HOSTILE_LINES:
            log.write(line + b"\n")
        log.write(b'{"time": 1795400001.0, "event": "note"}\n')
    log = read_log(log_path)
    assert any(f"{len(_HOSTILE_LINES)} malformed line(s) skipped" in note for note in log.notes)
    assert log.records[-1]["event"] == "note"
    output = tmp_path / "report.html"
    assert main(["report", str(log_path.parent), "-o", str(output)]) == 0
    assert "malformed line(s) skipped" in output.read_text(encoding="utf-8")
