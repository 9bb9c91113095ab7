"""Run-directory records: atomic writes by training processes, tolerant reads by the daemon."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

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

    run = tmp_path / "job"
    run.mkdir()
    os.mkfifo(run / "rank-0.json")  # reading it would block the daemon forever
    (run / "rank-1.json").symlink_to("/dev/zero")  # its size says 0, its content never ends
    records, problems = read_records(tmp_path)
    assert records == []
    assert {p.path.name for p in problems} == {"rank-0.json", "rank-1.json"}


def test_a_ranks_other_files_beside_its_record_are_neither_records_nor_problems(
    tmp_path: Path,
) -> None:
    shutil.copytree(FIXTURES / "job", tmp_path / "job")
    others = {"rank-5.skip_batches.json", "rank-5.verdict.json", "rank-5.checks.json"}
    for name in others:
        (tmp_path / "job" / name).write_text("[]")
    records, problems = read_records(tmp_path)
    assert [r.rank for r in records] == [5, 8]
    assert not others & {problem.path.name for problem in problems}


def test_read_records_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    assert read_records(tmp_path / "gone") == ([], [])


def test_write_atomic_leaves_no_temporary_file_and_replaces_whole(tmp_path: Path) -> None:
    target = tmp_path / "rank-0.json"
    write_atomic(target, b"old")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["rank-0.json"]


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


def _chowned(path: Path, uid: int) -> None:
    os.chown(path, uid, uid)
    for child in path.iterdir():
        os.chown(child, uid, uid)


def test_one_owners_junk_never_pushes_out_another_owners_record_under_a_tight_budget(
    tmp_path: Path,
) -> None:
    import pytest

    from stabmon.shared.rundir import MIN_FILES_PER_OWNER, ReadBudget, read_owned_records

    if os.geteuid() != 0:
        pytest.skip("Requires: root, to give files a second owner")
    junk = tmp_path / "aaa"
    junk.mkdir()
    for index in range(200):
        (junk / f"rank-{index}.json").write_text("{not json")
    _chowned(junk, 65534)
    (tmp_path / "zzz").mkdir()
    record = ProcessRecord(pid=1, create_time=1.0, run="zzz", rank=0)
    write_atomic(tmp_path / "zzz" / "rank-0.json", record.to_json())
    ticks = iter(range(10**6))
    budget = ReadBudget(seconds=6, clock=lambda: float(next(ticks)))  # a few files in all
    records, problems = read_owned_records(tmp_path, budget=budget)
    assert [entry.record.run for entry in records] == ["zzz"]  # read in turn, not after theirs
    summary = [p for p in problems if "not read" in p.reason]
    assert len(summary) == 1 and summary[0].owner_uid == 65534
    # Each user gets MIN_FILES_PER_OWNER files, then the clock rules: not one problem per file.
    assert MIN_FILES_PER_OWNER < len(problems) < MIN_FILES_PER_OWNER + 20


def test_a_record_outside_its_runs_directory_or_under_another_rank_is_refused(
    tmp_path: Path,
) -> None:
    (tmp_path / "elsewhere").mkdir()
    record = ProcessRecord(pid=1, create_time=1.0, run="victim", rank=0)
    write_atomic(tmp_path / "elsewhere" / "rank-0.json", record.to_json())
    (tmp_path / "victim").mkdir()
    write_atomic(tmp_path / "victim" / "rank-3.json", record.to_json())
    records, problems = read_records(tmp_path)
    assert records == []
    assert [p.refused for p in problems] == [True, True]
