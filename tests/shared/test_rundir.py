"""Run-directory records: atomic writes by training processes, tolerant reads by the daemon."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import MonitorFactory
from helpers import tiny_model, train_step
from hypothesis import given, settings
from hypothesis import strategies as st

from stabmon.shared.rundir import ProcessRecord, read_records, write_atomic

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rundir"


def test_read_records_skips_partial_malformed_and_foreign_files_with_a_reason(
    tmp_path: Path,
) -> None:
    shutil.copytree(FIXTURES, tmp_path, dirs_exist_ok=True)
    (tmp_path / "job" / "rank-6.json").mkdir()  # a directory where a file should be
    (tmp_path / "job" / "rank-7.json").write_bytes(b" " * (65 * 1024))  # oversized
    records, problems = read_records(tmp_path)
    # rank-8 was written by a newer library: its unknown fields are ignored.
    assert [(r.rank, r.pid, r.steps) for r in records] == [(5, 4242, 10), (8, 4243, 0)]
    assert records[0].gpu_uuids == ("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",)
    reasons = {p.path.name: p.reason for p in problems}
    assert set(reasons) == {f"rank-{i}.json" for i in (0, 1, 2, 3, 4, 6, 7)}
    assert "pid must be an integer" in reasons["rank-2.json"]
    assert "version" in reasons["rank-4.json"]
    assert "larger than" in reasons["rank-7.json"]


def test_read_records_refuses_a_fifo_and_a_symlink_to_an_endless_device(tmp_path: Path) -> None:
    import os

    run = tmp_path / "job"
    run.mkdir()
    os.mkfifo(run / "rank-0.json")  # reading it would block the daemon forever
    (run / "rank-1.json").symlink_to("/dev/zero")  # its size says 0, its content never ends
    records, problems = read_records(tmp_path)
    assert records == []
    assert {p.path.name for p in problems} == {"rank-0.json", "rank-1.json"}


def test_read_records_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    assert read_records(tmp_path / "gone") == ([], [])


def test_write_atomic_leaves_no_temporary_file_and_replaces_whole(tmp_path: Path) -> None:
    target = tmp_path / "rank-0.json"
    write_atomic(target, b"old")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["rank-0.json"]


def test_attached_process_registers_heartbeats_and_deregisters(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, sample_seconds=0.1, run_id="job-a")
    (record,), problems = read_records(tmp_path)
    assert not problems
    assert record.pid == psutil.Process().pid
    assert abs(record.create_time - psutil.Process().create_time()) < 0.01
    assert (record.run, record.rank, record.last_step_unix) == ("job-a", 0, None)
    assert record.metrics_url == monitor.metrics_url
    train_step(model, optimizer, monitor)
    deadline = time.monotonic() + 5
    while (record := read_records(tmp_path)[0][0]).steps == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # the heartbeat thread rewrites the record every 0.1 s
    assert record.steps == 1 and record.last_step_unix is not None
    monitor.detach()
    assert read_records(tmp_path) == ([], [])


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)


_KEYS = [
    "version",
    "pid",
    "create_time",
    "run",
    "rank",
    "gpu_uuids",
    "last_step_unix",
    "steps",
    "x",
]


@settings(max_examples=200, deadline=None, database=None)
@given(st.dictionaries(st.sampled_from(_KEYS), _values))
def test_record_reader_never_crashes_on_arbitrary_json(data: dict[str, object]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        run = Path(root) / "job"
        run.mkdir()
        try:
            payload = json.dumps(data).encode()
        except ValueError:  # NaN is not JSON: write it the way a broken writer would
            payload = json.dumps(data, allow_nan=True).encode()
        (run / "rank-0.json").write_bytes(payload)
        records, problems = read_records(Path(root))
        assert len(records) + len(problems) == 1
        for record in records:
            ProcessRecord.from_mapping(json.loads(record.to_json()))  # a read record round-trips


@settings(max_examples=200, deadline=None, database=None)
@given(
    payload=st.one_of(
        st.binary(max_size=300),
        st.text(max_size=300).map(str.encode),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
            lambda children: (
                st.lists(children, max_size=3)
                | st.dictionaries(st.text(max_size=10), children, max_size=3)
            ),
            max_leaves=10,
        ).map(lambda data: json.dumps(data).encode()),
    ),
    name=st.sampled_from(["rank-0.json", "rank-x.json", "rank--1.json", "rank-0.json.tmp"]),
)
def test_record_reader_never_crashes_on_arbitrary_bytes(payload: bytes, name: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        run = Path(root) / "job"
        run.mkdir()
        (run / name).write_bytes(payload)
        records, problems = read_records(Path(root))
        assert len(records) + len(problems) <= 1


# One interpreter imports torch and stabmon, then forks a child per ending (a fresh interpreter
# each costs seconds of CPU); each child attaches, ends as told, and leaves through the
# interpreter's own exit (its atexit, its excepthook), as a training script does.
_ENDINGS_SCRIPT = """
import os, sys
import torch, stabmon, stabmon.monitor
children = []
for run_dir, ending in zip(sys.argv[1::2], sys.argv[2::2]):
    pid = os.fork()
    if pid == 0:
        break
    children.append(pid)
else:  # the parent: waits for every child, and ends without a word
    for pid in children:
        os.waitpid(pid, 0)
    os._exit(0)
model = torch.nn.Linear(2, 1)
mon = stabmon.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), port=0,
                     run_dir=run_dir, run_id="job")
if ending == "raise":
    raise RuntimeError("the training loop failed")
if ending == "detach":
    mon.detach()
if ending.startswith("exit "):
    code = ending[len("exit "):]
    sys.exit(int(code) if code.isdigit() else code)  # a code, or a message (exit status 1)
"""
_ENDINGS = {
    "raise": "exception",
    "return": "clean",
    "detach": None,
    "exit 1": "exception",  # sys.exit(1): a failed run, whatever its scheduler is told
    "exit 0": "clean",
    "exit the loop gave up": "exception",
}


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The run directory of each ending, once every child has ended."""
    run_dirs = {ending: tmp_path_factory.mktemp("ended") for ending in _ENDINGS}
    arguments = []
    for ending, run_dir in run_dirs.items():
        arguments += [str(run_dir), ending]
    # A session of its own: on a timeout, the forked children are killed with the parent.
    parent = subprocess.Popen([sys.executable, "-c", _ENDINGS_SCRIPT, *arguments],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)  # fmt: skip
    try:
        _, stderr = parent.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # none left: every child ended
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)
    assert parent.returncode == 0, stderr.decode(errors="replace")[-3000:]
    return run_dirs


@pytest.mark.slow  # real processes exiting: make test runs them
@pytest.mark.parametrize(("ending", "expected"), _ENDINGS.items())
def test_record_tells_a_crash_from_a_clean_end(
    ended: dict[str, Path], ending: str, expected: str | None
) -> None:
    records, problems = read_records(ended[ending])
    assert not problems
    if expected is None:
        assert records == []  # detached: deregistered
    else:
        (record,) = records
        assert record.exit_status == expected and record.exited_unix is not None
