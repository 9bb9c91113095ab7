"""stabmon.report.events read a line at a time: ``select`` and ``follow_symlinks``, and lines
too long to be a record (the rest of reading is tests/report/test_events.py's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stabmon.report import events
from stabmon.report.events import read_log, read_run


def _log(path: Path, *records: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"time": 1000.0, **r}) + "\n" for r in records))
    return path


def test_select_keeps_what_it_returns_and_drops_none(tmp_path: Path) -> None:
    path = _log(tmp_path / "rank-2.events.jsonl", {"event": "attach"}, {"event": "step_sample"},
                {"event": "detach", "step": 4})  # fmt: skip
    seen: list[tuple[int, str]] = []

    def select(rank: int, record: dict[str, Any]) -> dict[str, Any] | None:
        seen.append((rank, record["event"]))
        return None if record["event"] == "step_sample" else {"event": record["event"]}

    log = read_log(path, select=select)

    assert seen == [(2, "attach"), (2, "step_sample"), (2, "detach")]
    assert log.records == [{"event": "attach"}, {"event": "detach"}]


def test_a_symlinked_log_is_followed_by_default_and_refused_when_asked(tmp_path: Path) -> None:
    target = _log(tmp_path / "real" / "rank-0.events.jsonl", {"event": "attach"})
    link = tmp_path / "run" / "rank-0.events.jsonl"
    link.parent.mkdir()
    link.symlink_to(target)

    assert len(read_run(link.parent).ranks[0].records) == 1
    refused = read_run(link.parent, follow_symlinks=False).ranks[0]
    assert refused.records == []
    assert "is a symbolic link; not followed" in refused.notes[0]


def test_a_line_longer_than_any_record_is_skipped_as_malformed(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(events, "MAX_LINE_BYTES", 64)
    path = tmp_path / "rank-0.events.jsonl"
    long = json.dumps({"time": 1000.0, "event": "anomaly", "detail": "x" * 500})
    path.write_text('{"event": "attach"}\n' + long + "\n" + '{"event": "detach"}\n')

    log = read_log(path)

    assert [r["event"] for r in log.records] == ["attach", "detach"]
    assert log.notes == ["rank-0.events.jsonl: 1 malformed line(s) skipped (line 2)"]


def test_a_line_one_byte_over_with_its_newline_does_not_take_the_next_record_along(
    tmp_path: Path, monkeypatch: Any
) -> None:
    # 64 bytes and a newline: read whole in one go (65 bytes), so nothing of it is left to
    # skip; the record after it is the next line, and must be read.
    monkeypatch.setattr(events, "MAX_LINE_BYTES", 64)
    path = tmp_path / "rank-0.events.jsonl"
    path.write_text('{"event": "attach"}\n' + "x" * 64 + "\n" + '{"event": "detach"}\n')

    log = read_log(path)

    assert [r["event"] for r in log.records] == ["attach", "detach"]


def test_malformed_lines_are_counted_whole_and_listed_first_ten(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.events.jsonl"
    path.write_text('{"event": "attach"}\n' + "not json\n" * 25)

    (note,) = read_log(path).notes

    assert note == ("rank-0.events.jsonl: 25 malformed line(s) skipped "
                    "(line 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 ...)")  # fmt: skip
