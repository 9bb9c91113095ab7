"""stabmon.daemon.xid_state: XID counts that survive a daemon restart, kept in a real file
in tmp_path; hostile directories and files (symlink, FIFO, another owner by an injected
uid, corrupt JSON) are refused with one log line and the counts live in memory."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from stabmon.contract import GPU_XID_LAST_EVENT
from stabmon.daemon.xid_state import MAX_ENTRIES, XidEntry, XidState, XidStateCollector, state_path
from stabmon.shared.log import LogLimiter


def _state(path: Path | None, **kwargs: object) -> XidState:
    return XidState(path, limiter=LogLimiter(), **kwargs)  # type: ignore[arg-type]


def test_a_restarted_daemon_continues_the_counts_and_times(tmp_path: Path) -> None:
    path = state_path(tmp_path)
    first = _state(path)
    first.record(0, "GPU-a", 79, now=100.0)
    first.record(0, "GPU-a", 79, now=200.0)
    first.record(1, "GPU-b", 48, now=150.0)
    restarted = _state(path)
    assert restarted.entries() == {
        ("GPU-a", 79): XidEntry(0, 2, 200.0),
        ("GPU-b", 48): XidEntry(1, 1, 150.0),
    }
    assert restarted.counts() == {(0, "GPU-a", 79): 2, (1, "GPU-b", 48): 1}


def test_the_state_directory_is_created_private(tmp_path: Path) -> None:
    path = state_path(tmp_path)
    _state(path).record(0, "GPU-a", 13, now=1.0)
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert json.loads(path.read_text())["xids"][0]["count"] == 1


def test_a_state_kept_in_memory_only_writes_nothing(tmp_path: Path) -> None:
    state = _state(None)
    state.record(0, "GPU-a", 79, now=1.0)
    assert state.counts() == {(0, "GPU-a", 79): 1}
    assert list(tmp_path.iterdir()) == []


def test_new_pairs_beyond_the_bound_are_not_counted_but_known_ones_are(tmp_path: Path) -> None:
    state = _state(None)
    for xid in range(MAX_ENTRIES):
        state.record(0, "GPU-a", xid, now=1.0)
    state.record(0, "GPU-a", MAX_ENTRIES, now=2.0)
    state.record(0, "GPU-a", 0, now=3.0)
    entries = state.entries()
    assert len(entries) == MAX_ENTRIES
    assert ("GPU-a", MAX_ENTRIES) not in entries
    assert entries[("GPU-a", 0)] == XidEntry(0, 2, 3.0)


def test_a_directory_of_another_owner_is_refused_and_counts_stay_in_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = state_path(tmp_path)
    path.parent.mkdir(mode=0o700)
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "xids": [{"uuid": "GPU-a", "xid": 79, "index": 0, "count": 50, "last_unix": 1.0}],
            }
        )
    )
    other = os.geteuid() + 1  # the injected owner check: as if the daemon ran as another uid
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        state = _state(path, uid=lambda: other)
        state.record(0, "GPU-a", 79, now=5.0)
    assert state.counts() == {(0, "GPU-a", 79): 1}  # the planted 50 was not trusted
    assert json.loads(path.read_text())["xids"][0]["count"] == 50  # and not overwritten
    assert "not keeping XID state" in caplog.text and "belongs to uid" in caplog.text


def test_a_symlinked_state_directory_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = state_path(run_dir)
    path.parent.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        _state(path).record(0, "GPU-a", 79, now=1.0)
    assert list(elsewhere.iterdir()) == []
    assert "not a directory (a symlink or a file)" in caplog.text


@pytest.mark.parametrize("plant", ["symlink", "fifo", "corrupt", "bad-entry", "too-large"])
def test_a_state_file_that_is_not_a_good_document_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, plant: str
) -> None:
    path = state_path(tmp_path)
    path.parent.mkdir(mode=0o700)
    if plant == "symlink":
        target = tmp_path / "target.json"
        target.write_text(json.dumps({"version": 1, "xids": []}))
        path.symlink_to(target)
    elif plant == "fifo":
        os.mkfifo(path)
    elif plant == "corrupt":
        path.write_text("{not json")
    elif plant == "bad-entry":
        path.write_text(
            json.dumps(
                {"xids": [{"uuid": "GPU-a", "xid": -1, "index": 0, "count": 1, "last_unix": 1.0}]}
            )
        )
    else:
        path.write_text(" " * (256 * 1024 + 1))
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        state = _state(path)
    assert state.entries() == {}
    assert "ignoring the XID state" in caplog.text


def test_the_collector_exports_the_last_event_time_per_gpu_and_xid(tmp_path: Path) -> None:
    state = _state(None)
    state.record(2, "GPU-c", 79, now=1_700_000_000.0)
    registry = CollectorRegistry()
    registry.register(XidStateCollector(state))
    labels = dict(zip(GPU_XID_LAST_EVENT.labels, ["2", "GPU-c", "79"], strict=True))
    assert registry.get_sample_value(GPU_XID_LAST_EVENT.name, labels) == 1_700_000_000.0
