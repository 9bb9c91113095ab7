"""`stabmon compare A B` on real short CPU trainings with stabmon attached, varied one way
at a time: a slow batch fetch, another OMP_NUM_THREADS, another batch size, a NaN episode,
and two ranks of two runs in processes of their own. Each run is bounded by steps and timed
by a loop clock that moves as a real step would (compare_helpers.train), so a busy machine
moves no figure: identical runs compare equal, and a variant moves only what it changes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from compare_helpers import attach_record, throughput_records, train, write_run
from report_helpers import stabmon_cli

from stabmon.cli import main

HERE = Path(__file__).resolve().parent
STEADY = {"data_wait": 0.001, "forward": 0.004, "backward": 0.004, "optimizer": 0.001}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The clean run and one variant of it per test, trained once for the module (seconds)."""
    root = tmp_path_factory.mktemp("runs")
    found = {
        "clean": train(root, "clean"),
        "slow-input": train(root, "slow-input", fetch_sleep=0.01),
        "batch-8": train(root, "batch-8", batch=8),
        "nan": train(root, "nan", nan_step=30),
        # Identical runs, 5 ms more in each fetch than the clean run.
        **{name: train(root, name, fetch_sleep=0.005) for name in ("same-1", "same-2", "same-3")},
        "short": train(root, "short", steps=60),
        "nan-late": train(root, "nan-late", nan_step=100),
    }
    with pytest.MonkeyPatch.context() as patch:  # attach records the variables it sees
        patch.setenv("OMP_NUM_THREADS", _other_omp_threads())
        found["omp"] = train(root, "omp", fetch_sleep=0.005)  # a step like same-1's
    return found


def _other_omp_threads() -> str:
    return "3" if os.environ.get("OMP_NUM_THREADS") != "3" else "2"


def _compare(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["compare", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _row(result: dict[str, Any], phase: str, rank: int | None = None) -> dict[str, Any]:
    (row,) = [r for r in result["step_time"]["rows"] if r["phase"] == phase and r["rank"] == rank]
    return row


def test_compare_names_data_wait_when_b_sleeps_in_each_batch_fetch(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = _compare(capsys, str(runs["clean"]), str(runs["slow-input"]))

    assert code == 1
    assert result["verdict"]["status"] == "regressed"
    assert result["step_time"]["comparable"] and result["step_time"]["moved_most"] == "data_wait"
    data_wait = _row(result, "data_wait")
    assert data_wait["moved"] == "slower" and data_wait["change"] >= 0.10
    assert _row(result, "step")["moved"] == "slower"
    assert result["environment"] == []
    lines = result["verdict"]["lines"]
    assert any("the phase that moved most: data_wait" in line for line in lines)


def test_compare_prints_the_verdict_and_each_section_for_a_person(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["compare", str(runs["clean"]), str(runs["slow-input"])])

    out = capsys.readouterr().out
    assert code == 1
    assert out.splitlines()[4] == "Verdict: REGRESSED"
    for title in ("Environment (only what differs)", "Step time per phase", "Throughput",
                  "Memory", "AMP (GradScaler)", "Anomalies by kind", "Goodput"):  # fmt: skip
        assert title in out
    assert "  no difference" in out


def test_compare_shows_a_changed_omp_num_threads_with_both_values(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = _compare(capsys, str(runs["same-1"]), str(runs["omp"]))

    # torch read its thread count at import: B runs the same code on the same threads.
    assert code == 0
    assert {"key": "OMP_NUM_THREADS", "a": os.environ.get("OMP_NUM_THREADS"),
            "b": _other_omp_threads()} in result["environment"]  # fmt: skip
    assert [d["key"] for d in result["environment"]] == ["OMP_NUM_THREADS"]


def test_compare_is_inconclusive_when_the_batch_sizes_differ(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = _compare(capsys, str(runs["clean"]), str(runs["batch-8"]))

    assert code == 0
    assert result["verdict"]["status"] == "inconclusive"
    reasons = result["step_time"]["inconclusive_reasons"]
    assert "batch size differs (A 4, B 8 samples per step, rank 0)" in reasons
    assert all(row["moved"] is None for row in result["step_time"]["rows"])
    main(["compare", str(runs["clean"]), str(runs["batch-8"])])
    assert "INCONCLUSIVE: batch size differs (A 4, B 8" in capsys.readouterr().out


def test_compare_lists_a_nan_episode_against_a_clean_run_as_anomaly_rows(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = _compare(capsys, str(runs["clean"]), str(runs["nan"]))

    assert code == 1
    (row,) = [r for r in result["anomalies"] if r["kind"] == "nonfinite_grad"]
    assert row["a"] == {"count": 0, "steps": [], "ranks": []}
    assert row["b"] == {"count": 1, "steps": [30], "ranks": [0]}
    assert "new in B: nonfinite_grad x1 (step(s) 30)" in result["verdict"]["lines"]
    _, reverse = _compare(capsys, str(runs["nan"]), str(runs["clean"]))
    assert "gone in B: nonfinite_grad (A had 1)" in reverse["verdict"]["lines"]


def test_compare_of_identical_runs_with_many_blocks_never_regresses(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    same = [runs["same-1"], runs["same-2"], runs["same-3"]]
    results = [_compare(capsys, str(a), str(b)) for a in same for b in same if a != b]

    assert [code for code, _ in results] == [0] * 6
    for _, result in results:
        assert result["step_time"]["comparable"], result["step_time"]["inconclusive_reasons"]
        assert _row(result, "step")["moved"] != "slower"


def test_compare_of_identical_runs_with_one_block_each_is_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The default record interval (60 s): a short run writes one throughput record, at detach.
    a, b = (train(tmp_path, name, record_seconds=60.0) for name in ("one-a", "one-b"))

    code, result = _compare(capsys, str(a), str(b))

    assert code == 0 and result["verdict"]["status"] == "inconclusive"
    (reason,) = result["step_time"]["inconclusive_reasons"]
    assert reason == (
        "too few blocks to compare step time (A rank 0: 0, B rank 0: 0 in steps 10-119; 4 "
        "needed); set throughput.record_seconds lower or run longer"
    )
    assert {row["a"] for row in result["step_time"]["rows"]} == {None}  # no warm-up block


def test_compare_finds_a_slowdown_when_each_epoch_ends_in_a_short_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 4 samples a batch over 10 a dataset: 4, 4, 2; each run's mean per step is 3.33 only
    # over whole epochs, so the steps compared decide it, within a tolerance.
    a = train(tmp_path, "short-batch", dataset=10, steps=121)
    b = train(tmp_path, "short-batch-slow", dataset=10, steps=120, fetch_sleep=0.01)

    code, result = _compare(capsys, str(a), str(b))

    assert code == 1 and result["step_time"]["inconclusive_reasons"] == []
    assert _row(result, "step")["moved"] == "slower"


def test_compare_counts_anomalies_only_in_the_steps_both_runs_reached(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, result = _compare(capsys, str(runs["short"]), str(runs["nan-late"]))

    assert result["anomalies"] == []
    assert not any("new in B" in line for line in result["verdict"]["lines"])
    assert result["notes"]["compare"] == [
        "anomalies are counted up to step 59, the last step both runs reached; 1 in B after "
        "it left out"
    ]


def test_compare_writes_a_page_with_both_runs_on_the_same_plots(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from stabmon.report.compare_html import SECTION_IDS

    page = tmp_path / "compare.html"
    code = main(["compare", str(runs["clean"]), str(runs["nan"]), "-o", str(page)])

    assert code == 1
    assert f"stabmon compare: {page}" in capsys.readouterr().out
    text = page.read_text(encoding="utf-8")
    assert all(f'id="{section}"' in text for section in SECTION_IDS)
    assert text.count("<svg") >= 3  # step time, phases, memory
    assert "A, rank 0" in text and "B, rank 0" in text and "<script" not in text


@pytest.mark.slow  # two torch processes, each started for a rank of both runs
def test_compare_of_two_multi_rank_runs_has_per_rank_and_whole_run_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two processes, each a rank of both runs (starting torch costs seconds, so once per rank);
    # both ranks of B sleep in their batch fetch, rank 1 longer (20 and 40 ms: well above what
    # a busy machine adds to run A's input wait). With rank 0 of B not slowed at all, the
    # whole run's pooled median sat between its two ranks and moved or not with the load.
    ranks = [_start_rank(tmp_path, rank, "two-a", f"two-b:{0.04 if rank else 0.02}")
             for rank in (0, 1)]  # fmt: skip
    for process in ranks:
        assert process.wait(timeout=120) == 0

    code, result = _compare(capsys, str(tmp_path / "two-a"), str(tmp_path / "two-b"))

    assert code == 1
    assert result["a"]["ranks"] == [0, 1] and result["a"]["world_size"] == 2
    assert {row["rank"] for row in result["step_time"]["rows"]} == {None, 0, 1}
    assert {row["rank"] for row in result["throughput"]} == {None, 0, 1}
    assert _row(result, "data_wait", rank=1)["moved"] == "slower"
    assert _row(result, "data_wait", rank=None)["moved"] == "slower"
    _, only = _compare(capsys, str(tmp_path / "two-a"), str(tmp_path / "two-b"), "--rank", "1")
    assert only["rank"] == 1 and {row["rank"] for row in only["step_time"]["rows"]} == {None}
    assert _row(only, "data_wait")["moved"] == "slower"


def _start_rank(run_dir: Path, rank: int, *runs: str) -> subprocess.Popen[bytes]:
    variables = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                 "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
    return subprocess.Popen(
        [sys.executable, str(HERE / "compare_trainee.py"), str(run_dir), *runs],
        env={**os.environ, **variables},
    )


# ------------------------------------------------------------------ bad input: exit 2


def _error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = main(["compare", *args])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("stabmon: error: ")
    return captured.err


def test_compare_of_a_missing_path_is_one_line_and_exit_2(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = _error(capsys, str(runs["clean"]), str(tmp_path / "nowhere"))
    assert f"run B: {tmp_path / 'nowhere'} does not exist; pass a run directory" in err


def test_compare_of_a_directory_without_event_logs_is_one_line_and_exit_2(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = _error(capsys, str(tmp_path), str(runs["clean"]))
    assert "run A: no event log (rank-<N>.events.jsonl) in" in err


def test_compare_of_a_run_whose_log_cannot_be_read_says_why(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "rank-0.events.jsonl").write_text("not json\n")
    err = _error(capsys, str(runs["clean"]), str(tmp_path))
    assert "run B: no record could be read from the event logs in" in err
    assert "1 malformed line(s) skipped (line 1)" in err


def test_compare_of_a_root_of_runs_names_one_of_them(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(capsys, str(runs["clean"].parent), str(runs["clean"]))
    assert "holds runs, not one run's logs; pass one of them, such as" in err


def test_compare_of_one_event_log_asks_for_its_directory(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(capsys, str(runs["clean"] / "rank-0.events.jsonl"), str(runs["clean"]))
    assert "is not a directory" in err


def test_compare_does_not_follow_a_symlinked_run_directory(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    link = tmp_path / "link"
    link.symlink_to(runs["clean"])
    err = _error(capsys, str(link), str(runs["clean"]))
    assert "is a symbolic link, which compare does not follow" in err


def test_compare_of_a_rank_one_run_lacks_is_one_line_and_exit_2(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(capsys, str(runs["clean"]), str(runs["nan"]), "--rank", "3")
    assert "--rank 3: run A (clean) has no rank 3 (its ranks: 0)" in err


def test_compare_into_a_missing_folder_is_one_line_and_exit_2(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    page = tmp_path / "missing" / "page.html"
    err = _error(capsys, str(runs["clean"]), str(runs["nan"]), "-o", str(page))
    assert f"the folder {page.parent} does not exist" in err


def test_compare_reads_runs_without_importing_torch(runs: dict[str, Path]) -> None:
    check = (
        "import sys; from stabmon.cli import main; "
        f"code = main(['compare', {str(runs['clean'])!r}, {str(runs['nan'])!r}, '--json']); "
        "sys.exit(3 if 'torch' in sys.modules else code)"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, timeout=60)
    assert result.returncode == 1, result.stderr


def test_compare_that_fails_unexpectedly_is_one_line_and_exit_2_never_1(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr("stabmon.report.compare.compare_runs", broken)

    err = _error(capsys, str(runs["clean"]), str(runs["nan"]))
    assert "compare failed on what the runs hold (ZeroDivisionError: float division" in err


def test_compare_reads_counts_beyond_a_float_as_absent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def process(time: float, samples: float) -> list[dict[str, Any]]:
        records = throughput_records([STEADY] * 4, start=time)
        return [attach_record(time), *({**r, "samples": samples} for r in records)]

    a = write_run(tmp_path / "a", {0: process(1000.0, 5e306) + process(2000.0, 5e306)})
    b = write_run(tmp_path / "b", {0: process(1000.0, 4) + process(2000.0, 4)})

    code, result = _compare(capsys, str(a), str(b))

    assert code == 0
    assert result["throughput"][0]["a"]["samples_per_second"] is None


def test_compare_into_a_closed_pipe_says_nothing(runs: dict[str, Path]) -> None:
    read, write = os.pipe()
    os.close(read)  # as `| head -1` does once it has its line
    with os.fdopen(write, "wb") as closed:
        result = subprocess.run(
            [sys.executable, "-m", "stabmon", "compare", str(runs["clean"]), str(runs["nan"]),
             "--json"], stdout=closed, stderr=subprocess.PIPE, timeout=60,
        )  # fmt: skip
    assert result.stderr == b""
    assert result.returncode == 1


def test_compare_json_has_the_keys_docs_compare_md_documents(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rows = _documented_json_rows()
    _, result = _compare(capsys, str(runs["clean"]), str(runs["nan"]))

    assert set(result) == {key.strip("` ") for cell in rows for key in cell.split(",")}
    for parent, cell in (("a", "`a`, `b`"), ("b", "`a`, `b`"), ("verdict", "`verdict`"),
                         ("step_time", "`step_time`")):  # fmt: skip
        assert {f"`{key}`" for key in result[parent]} <= _backticked(rows[cell]), parent
    assert set(result["step_time"]["rows"][0]) == _braces(rows["`step_time`"])
    assert set(result["step_time"]["rows"][0]["a"]) == _braces(rows["`step_time`"], 1)
    assert set(result["throughput"][0]["a"]) == _braces(rows["`throughput`"], 1)
    assert set(result["memory"][0]["a"]) == _braces(rows["`memory`"], 1)
    assert set(result["anomalies"][0]["a"]) == {"count", "steps", "ranks"}
    assert set(result["notes"]) == {key.split(":")[0] for key in _braces(rows["`notes`"])}


def _documented_json_rows() -> dict[str, str]:
    """docs/compare.md's JSON table: the key cell to the holds cell."""
    text = (HERE.parent.parent / "docs" / "compare.md").read_text(encoding="utf-8")
    table = text[text.index("| key | holds |") : text.index("The NaN example above")]
    cells = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    return {cell[0].removeprefix("| "): cell[1] for cell in cells}


def _backticked(cell: str) -> set[str]:
    return set(re.findall(r"`[a-z_0-9]+`", cell))


def _braces(cell: str, index: int = 0) -> set[str]:
    """The names in the ``index``-th ``{a, b, c}`` of a cell."""
    inner = re.findall(r"\{([^{}]*)\}", cell)[index]
    return {key.strip() for key in inner.split(",")}


def test_compare_as_a_command_exits_2_with_one_line(tmp_path: Path) -> None:
    result = stabmon_cli("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("stabmon: error: run A:") and result.stderr.count("\n") == 1
