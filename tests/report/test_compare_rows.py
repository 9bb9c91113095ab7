"""stabmon.report.compare_rows: environment, memory, AMP, anomaly, throughput and goodput rows,
on event logs written by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from compare_helpers import attach_record, throughput_records, write_run

from stabmon.report.compare import compare_runs
from stabmon.report.compare_rows import (
    amp_rows,
    anomaly_rows,
    environment_rows,
    goodput_rows,
    memory_rows,
    throughput_rows,
)
from stabmon.report.digest import RankDigest, RunDigest, read_digest


def _read(path: Path, ranks: dict[int, list[dict[str, Any]]]) -> RunDigest:
    return read_digest(write_run(path, ranks))


def test_environment_rows_hold_only_what_differs_with_both_values(tmp_path: Path) -> None:
    a = _read(tmp_path / "a", {0: [attach_record(OMP_NUM_THREADS="4", NCCL_DEBUG="INFO")]})
    b = _read(
        tmp_path / "b", {0: [attach_record(NCCL_DEBUG="INFO", TORCH_SHOW_CPP_STACKTRACES="1")]}
    )

    rows = environment_rows(a, b, a.ranks, b.ranks)

    assert rows == [
        {"key": "OMP_NUM_THREADS", "a": "4", "b": None},
        {"key": "TORCH_SHOW_CPP_STACKTRACES", "a": None, "b": "1"},
    ]


def test_environment_rows_name_each_rank_where_the_ranks_differ(tmp_path: Path) -> None:
    gpu = {"versions": {}, "cuda_available": True, "cuda_device_count": 1}
    ranks_a = {r: [{**attach_record(), "environment": {**gpu, "gpus": [{"name": "H100",
               "uuid": f"GPU-{r}"}]}}] for r in (0, 1)}  # fmt: skip
    ranks_b = {r: [{**attach_record(), "environment": {**gpu, "gpus": [{"name": "H100",
               "uuid": "GPU-0"}]}}] for r in (0, 1)}  # fmt: skip
    a, b = _read(tmp_path / "a", ranks_a), _read(tmp_path / "b", ranks_b)

    (row,) = environment_rows(a, b, a.ranks, b.ranks)

    assert row == {"key": "gpu_uuids", "a": "rank 0: GPU-0; rank 1: GPU-1", "b": "GPU-0"}


def test_world_size_is_an_environment_row_when_it_differs(tmp_path: Path) -> None:
    a = _read(tmp_path / "a", {0: [attach_record()]})
    b = _read(tmp_path / "b", {0: [attach_record()], 1: [attach_record()]})

    rows = environment_rows(a, b, a.ranks, b.ranks)

    assert {"key": "world_size", "a": "1", "b": "2"} in rows
    assert {"key": "ranks_per_node", "a": "1", "b": "2"} in rows


def test_anomaly_rows_count_each_kind_with_its_steps_and_ranks(tmp_path: Path) -> None:
    def anomaly(kind: str, step: int) -> dict[str, Any]:
        return {"time": 1000.0 + step, "event": "anomaly", "kind": kind, "step": step}

    a = _read(tmp_path / "a", {0: [attach_record(), anomaly("loss_spike", 40)]})
    b = _read(tmp_path / "b", {0: [attach_record(), anomaly("nonfinite_grad", 7)],
                               1: [attach_record(), anomaly("nonfinite_grad", 9)]})  # fmt: skip

    rows = anomaly_rows(a.ranks, b.ranks, last=100)

    assert rows == [
        {"kind": "loss_spike", "a": {"count": 1, "steps": [40], "ranks": [0]},
         "b": {"count": 0, "steps": [], "ranks": []}},
        {"kind": "nonfinite_grad", "a": {"count": 0, "steps": [], "ranks": []},
         "b": {"count": 2, "steps": [7, 9], "ranks": [0, 1]}},
    ]  # fmt: skip


def test_memory_rows_give_peak_slope_after_warm_up_and_leak(tmp_path: Path) -> None:
    def epochs(per_step: float, leak: bool) -> list[dict[str, Any]]:
        return [{"time": 1000.0 + e, "event": "epoch", "epoch": e, "step": 100 * e + 99,
                 "memory": {"host": 1e6 + per_step * 100 * e}, "leak_suspected": {"host": leak}}
                for e in range(4)]  # fmt: skip

    a = _read(tmp_path / "a", {0: [attach_record(), *epochs(0.0, False)]})
    b = _read(tmp_path / "b", {0: [attach_record(), *epochs(512.0, True)]})

    (row,) = memory_rows(a.ranks, b.ranks, warmup=100)

    assert row["rank"] == 0 and row["device"] == "host"
    assert row["a"] == {"peak_bytes": 1e6, "slope_bytes_per_step": 0.0, "leak": False}
    assert row["b"]["slope_bytes_per_step"] == pytest.approx(512.0)
    assert row["b"]["peak_bytes"] == 1e6 + 512.0 * 300 and row["b"]["leak"] is True


def test_amp_rows_give_the_scales_and_the_skipped_steps(tmp_path: Path) -> None:
    samples = [{"time": 1000.0, "event": "step_sample", "step": s, "amp_loss_scale": scale}
               for s, scale in ((0, 65536.0), (50, 32768.0), (100, 65536.0))]  # fmt: skip
    skip = {"time": 1000.0, "event": "amp_skip", "step": 42, "scale": 32768.0}
    a = _read(tmp_path / "a", {0: [attach_record()]})
    b = _read(tmp_path / "b", {0: [attach_record(), *samples, skip]})

    assert amp_rows(a.ranks, b.ranks) == [
        {"rank": 0, "a": None,
         "b": {"last_scale": 65536.0, "min_scale": 32768.0, "skipped_steps": 1}},
    ]  # fmt: skip
    assert amp_rows(a.ranks, a.ranks) == []


def test_throughput_rows_have_a_whole_run_row_and_one_per_rank(tmp_path: Path) -> None:
    records = [attach_record(), *throughput_records([{"forward": 0.01}] * 3)]
    a = _read(tmp_path / "a", {0: records, 1: records})

    rows = throughput_rows(a.ranks, a.ranks)

    assert [row["rank"] for row in rows] == [None, 0, 1]
    whole = rows[0]["a"]
    assert whole["steps"] == 30 and whole["samples_per_step"] == 4
    assert whole["samples_per_second"] == pytest.approx(2 * whole["steps_per_second"] * 4)


def test_goodput_rows_give_each_cause_its_share_training_first(tmp_path: Path) -> None:
    records = [attach_record(), *throughput_records([{"forward": 0.01, "data_wait": 0.01}] * 3)]
    a = _read(tmp_path / "a", {0: records})

    rows = goodput_rows(a.ranks, a.ranks)

    assert rows[0]["cause"] == "training" and rows[0]["a"] == rows[0]["b"]
    shares = {row["cause"]: row["a"] for row in rows}
    assert shares["training"] == pytest.approx(shares["data_wait"])
    assert sum(shares.values()) == pytest.approx(1.0)


# ------------------------------------------------- what compare_runs leaves out, and why

STEADY = {"data_wait": 0.001, "forward": 0.004, "backward": 0.004, "optimizer": 0.001}


def _process(per_step: dict[str, float] = STEADY, **variables: str) -> list[dict[str, Any]]:
    return [attach_record(**variables), *throughput_records([per_step] * 6)]


def test_compare_notes_a_rank_only_one_run_has_and_times_the_ranks_both_have(
    tmp_path: Path,
) -> None:
    slow = {**STEADY, "forward": 0.008}
    a = _read(tmp_path / "a", {0: _process(WORLD_SIZE="2"), 1: _process(slow, WORLD_SIZE="2")})
    b = _read(tmp_path / "b", {0: _process(WORLD_SIZE="2")})  # rank 1's log is missing

    result = compare_runs(a, b)

    (note,) = result.notes
    assert note.startswith("the runs' ranks differ (A 0, 1, B 0) though both have world size 2")
    assert result.verdict.status == "unchanged"  # rank 0 against rank 0, not {0, 1} against 0


def test_compare_ignores_an_anomaly_without_a_kind(tmp_path: Path) -> None:
    kindless = {"time": 1001.0, "event": "anomaly", "step": 3}
    a = _read(tmp_path / "a", {0: _process()})
    b = _read(tmp_path / "b", {0: [*_process(), kindless]})

    result = compare_runs(a, b)

    assert result.anomalies == [] and result.verdict.status == "unchanged"


def test_compare_drops_records_whose_step_is_negative(tmp_path: Path) -> None:
    records = _process()
    records[1:] = [{**r, "step": r["step"] - 1000} for r in records[1:]]
    b = _read(tmp_path / "b", {0: records})

    assert b.steps == 0 and b.ranks[0].blocks() == []
    assert b.notes == ["rank 0: 6 records with a negative step not read"]


def test_time_shifted_between_phases_is_a_change_not_a_regression(tmp_path: Path) -> None:
    shifted = {**STEADY, "forward": 0.002, "backward": 0.006}
    a, b = _read(tmp_path / "a", {0: _process()}), _read(tmp_path / "b", {0: _process(shifted)})

    verdict = compare_runs(a, b).verdict

    assert verdict.status == "changed" and not verdict.regressed
    assert verdict.lines[1] == (
        "backward +50%: 4 ms -> 6 ms per step (time shifted between phases: the step did not move)"
    )


def test_memory_rows_read_each_rank_once_however_many_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    devices = {f"cuda:{i}": 1.0 for i in range(50)}
    epochs = [{"time": 1001.0 + i, "event": "epoch", "step": i, "memory": devices}
              for i in range(5)]  # fmt: skip
    a = _read(tmp_path / "a", {0: [attach_record(), *epochs]})
    reads = []
    memory = RankDigest.memory
    monkeypatch.setattr(RankDigest, "memory", lambda self: reads.append(1) or memory(self))

    rows = memory_rows(a.ranks, a.ranks, warmup=0)

    assert len(rows) == 50 and len(reads) <= 4  # series and peaks, of each side
