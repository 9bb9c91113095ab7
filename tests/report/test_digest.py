"""stabmon.report.digest: a run read for comparison, from event logs written by hand."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
from compare_helpers import attach_record, throughput_records, write_run

from stabmon.report import digest
from stabmon.report.digest import read_digest


def test_blocks_are_the_seconds_per_step_between_two_throughput_records(tmp_path: Path) -> None:
    blocks = [{"forward": 0.01, "data_wait": 0.002}, {"forward": 0.03, "data_wait": 0.002}]
    records = [attach_record(), *throughput_records(blocks)]
    (rank,) = read_digest(write_run(tmp_path / "r", {0: records})).ranks

    first, second = rank.blocks()

    assert (first.first_step, first.last_step, second.first_step, second.last_step) == (
        0,
        9,
        10,
        19,
    )
    assert first.per_step == pytest.approx({"forward": 0.01, "data_wait": 0.002})
    assert second.per_step["forward"] == pytest.approx(0.03)
    assert second.step_seconds == pytest.approx(0.032)


def test_blocks_start_again_from_zero_after_a_restart(tmp_path: Path) -> None:
    before = throughput_records([{"forward": 0.01}] * 2)
    after = throughput_records([{"forward": 0.05}])  # a new process: totals from 0 again
    after[0]["step"] = 29  # resumed after step 19
    records = [attach_record(), *before, attach_record(2000.0), *after]
    (rank,) = read_digest(write_run(tmp_path / "r", {0: records})).ranks

    blocks = rank.blocks()

    assert [(b.first_step, b.last_step) for b in blocks] == [(0, 9), (10, 19), (20, 29)]
    assert blocks[-1].per_step["forward"] == pytest.approx(0.05)


def test_step_samples_are_folded_and_thinned_evenly_past_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(digest, "MAX_SAMPLES", 8)
    samples = [{"time": 1000.0 + s, "event": "step_sample", "step": s, "step_seconds": 0.01,
                "module_grad_norms": {"0": 1.0}} for s in range(40)]  # fmt: skip
    (rank,) = read_digest(write_run(tmp_path / "r", {0: [attach_record(), *samples]})).ranks

    steps = [sample.step for sample in rank.samples]

    assert len(steps) < 8 and steps[0] == 0 and steps == sorted(steps)
    assert len({b - a for a, b in zip(steps, steps[1:], strict=False)}) <= 2  # even strides
    assert all(r.get("event") != "step_sample" for r in rank.log.records)


def test_kept_records_lose_their_stacks(tmp_path: Path) -> None:
    stall = {"time": 1001.0, "event": "anomaly", "kind": "stall", "step": 3, "stacks": "x" * 9000}
    (rank,) = read_digest(write_run(tmp_path / "r", {0: [attach_record(), stall]})).ranks

    (kept,) = rank.log.of("anomaly")

    assert "stacks" not in kept and rank.anomalies() == [("stall", 3)]


def test_environment_facts_leave_out_the_launch_variables(tmp_path: Path) -> None:
    attach = attach_record(OMP_NUM_THREADS="4", MASTER_PORT="29500", RANK="0", WORLD_SIZE="2")
    run = read_digest(write_run(tmp_path / "r", {0: [attach]}))

    facts = run.ranks[0].environment()

    assert facts["OMP_NUM_THREADS"] == "4" and facts["torch_version"] == "2.13.0+cpu"
    assert "MASTER_PORT" not in facts and "RANK" not in facts and "WORLD_SIZE" not in facts
    assert facts["cuda_devices"] == "none" and facts["CUDA_VISIBLE_DEVICES"] == "unset"
    assert run.world_size() == 2


def test_world_size_without_a_launcher_is_the_number_of_rank_logs(tmp_path: Path) -> None:
    run = read_digest(write_run(tmp_path / "r", {0: [attach_record()], 1: [attach_record()]}))
    assert run.world_size() == 2 and run.ranks_per_node() == 2


def test_memory_peaks_and_leaks_come_from_epoch_records(tmp_path: Path) -> None:
    epochs = [{"time": 1000.0 + e, "event": "epoch", "epoch": e, "step": 10 * e + 9,
               "memory": {"cuda:0": 100.0 + e}, "peak": {"cuda:0": 500.0},
               "leak_suspected": {"cuda:0": e == 2}} for e in range(3)]  # fmt: skip
    (rank,) = read_digest(write_run(tmp_path / "r", {0: [attach_record(), *epochs]})).ranks

    assert rank.memory() == {"cuda:0": [(9, 100.0), (19, 101.0), (29, 102.0)]}
    assert rank.peaks() == {"cuda:0": 500.0}
    assert rank.leaks() == {"cuda:0"}


def test_a_symlinked_event_log_is_noted_and_not_read(tmp_path: Path) -> None:
    elsewhere = write_run(tmp_path / "elsewhere", {0: [attach_record()]})
    run_dir = write_run(tmp_path / "r", {0: [attach_record()]})
    (run_dir / "rank-1.events.jsonl").symlink_to(elsewhere / "rank-0.events.jsonl")

    run = read_digest(run_dir)

    assert [len(rank.log.records) for rank in run.ranks] == [1, 0]
    assert any("is a symbolic link; not followed" in note for note in run.notes)


def test_a_field_of_the_wrong_type_reads_as_absent(tmp_path: Path) -> None:
    bad = {"time": 1001.0, "event": "throughput", "step": 9, "steps": "ten",
           "phase_seconds": ["forward"]}  # fmt: skip
    sample = {"time": 1001.0, "event": "step_sample", "step": 5, "step_seconds": "nan",
              "amp_loss_scale": {"x": 1}}  # fmt: skip
    (rank,) = read_digest(write_run(tmp_path / "r", {0: [attach_record(), bad, sample]})).ranks

    assert rank.blocks() == []
    assert rank.samples[0].step_seconds is None and rank.samples[0].loss_scale is None
    assert json.dumps(rank.environment())  # plain strings


def test_nan_and_inf_figures_read_as_absent_and_stop_nothing(tmp_path: Path) -> None:
    hostile = {"time": 1001.0, "event": "throughput", "step": 9, "steps": "nan",
               "samples": "inf", "uptime_seconds": 1e400,
               "phase_seconds": {"forward": "inf", "backward": 0.5}}  # fmt: skip
    good = throughput_records([{"forward": 0.01}], start=1002.0)[0]
    records = [attach_record(), hostile, {**good, "step": 19, "steps": 20}]
    (rank,) = read_digest(write_run(tmp_path / "r", {0: records})).ranks

    (kept, _) = rank.log.of("throughput")

    assert kept == {"time": 1001.0, "event": "throughput", "step": 9, "run": "r", "rank": 0,
                    "phase_seconds": {"backward": 0.5}}  # fmt: skip
    assert rank.goodput is not None and rank.goodput.steps == 20
    assert [(b.first_step, b.last_step) for b in rank.blocks()] == [(0, 19)]


def test_kept_records_hold_only_what_compare_reads_so_memory_stays_bounded(
    tmp_path: Path,
) -> None:
    bulky = {"time": 1001.0, "event": "epoch", "step": 5, "memory": {"host": 1.0},
             "extra": {f"key-{i}": i for i in range(2000)}}  # fmt: skip
    run_dir = write_run(tmp_path / "r", {0: [attach_record(), *[bulky] * 300]})
    tracemalloc.start()
    try:
        (rank,) = read_digest(run_dir).ranks
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert rank.log.of("epoch")[0] == {"time": 1001.0, "event": "epoch", "step": 5, "run": "r",
                                       "rank": 0, "memory": {"host": 1.0}}  # fmt: skip
    assert peak < 8 * 2**20  # the log is 9 MiB; kept whole, its records would take ~80 MiB


def test_records_past_the_bytes_a_rank_may_keep_are_not_read_and_a_note_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("stabmon.report.digest.MAX_KEPT_BYTES", 20_000)
    records = [attach_record(), *throughput_records([{"forward": 0.01}] * 100)]

    run = read_digest(write_run(tmp_path / "r", {0: records}))

    kept = len(run.ranks[0].log.of("throughput"))
    assert 0 < kept < 100
    assert run.notes == [
        f"rank 0: {100 - kept} records not read, past the first 100,000 records or 0 MiB kept"
    ]


def test_a_text_too_long_for_a_stabmon_name_reads_as_absent(tmp_path: Path) -> None:
    long_kind = {"time": 1001.0, "event": "anomaly", "kind": "x" * 10_000, "step": 3}
    long_device = {"time": 1002.0, "event": "epoch", "step": 4, "memory": {"d" * 10_000: 1.0}}
    (rank,) = read_digest(write_run(tmp_path / "r", {0: [attach_record(), long_kind,
                                                         long_device]})).ranks  # fmt: skip

    assert rank.anomalies() == [] and rank.memory() == {}


def test_each_block_knows_when_it_began_and_ended(tmp_path: Path) -> None:
    records = [attach_record(1000.0), *throughput_records([{"forward": 0.01}] * 2)]

    (rank,) = read_digest(write_run(tmp_path / "r", {0: records})).ranks

    assert [(b.start_time, b.end_time) for b in rank.blocks()] == [(1000.0, 1000.1),
                                                                    (1000.1, 1000.2)]  # fmt: skip
