"""Issue 21, item 8: ``stabmon report`` on an event log holding anything at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from stabmon.cli import main
from stabmon.report.events import find_run, read_log
from tests.helpers import tiny_model, train_step
from tests.security.conftest import Hostile

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


# Issue 40: `stabmon report <root>` on a root every user writes.

_THEIR_RUN = (
    "import os, sys; d = os.path.join(sys.argv[1], 'zzz-theirs'); os.mkdir(d);"
    "p = os.path.join(d, 'rank-0.events.jsonl');"
    'open(p, \'w\').write(\'{"time": 1795400000.0, "event": "attach", "run": "zzz-theirs"}\\n\');'
    "os.utime(p, (4102444800, 4102444800))"  # dated 2100: "written last"
)


def test_report_of_a_root_takes_the_callers_run_not_another_users_log_dated_2100(
    attach, hostile: Hostile, shared: Path, tmp_path: Path
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, run_dir=str(shared), run_id="mine")
    for _ in range(3):
        train_step(model, optimizer, monitor)
    monitor.detach()
    hostile.run(_THEIR_RUN, str(shared))
    run_directory, _, notes = find_run(shared)
    assert run_directory.name == "mine"
    assert main(["report", str(shared), "-o", str(tmp_path / "report.html")]) == 0


def test_a_future_modification_time_does_not_make_a_run_the_latest(tmp_path: Path) -> None:
    for name, mtime in (("older", 1_000.0), ("touched", 10**10)):
        (tmp_path / name).mkdir()
        log = tmp_path / name / "rank-0.events.jsonl"
        log.write_text('{"time": 1.0, "event": "attach"}\n')
        os.utime(log, (mtime, mtime))
    run_directory, _, notes = find_run(tmp_path, now=2_000.0)
    assert run_directory.name == "older"
    assert any("in the future" in note for note in notes)


def test_a_log_of_empty_objects_keeps_nothing_and_records_past_the_cap_are_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stabmon.report.events as events

    log_path = tmp_path / "rank-0.events.jsonl"
    log_path.write_bytes(b"{}\n" * 200_000)  # each a JSON object, none a record
    log = read_log(log_path)
    assert log.records == []
    assert any("200000 malformed line(s) skipped" in note for note in log.notes)
    monkeypatch.setattr(events, "MAX_KEPT_RECORDS", 1000)
    log_path.write_bytes(b'{"event": "x"}\n' * 5000)
    log = read_log(log_path)
    assert len(log.records) == 1000
    assert any("4,000 records not kept" in note for note in log.notes)
