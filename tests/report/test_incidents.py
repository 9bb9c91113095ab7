"""stabmon.report.incidents: which rank went non-finite first, and each rank's provenance
and incident batches, read from real event logs of two ranks (written by the EventLog a
rank writes with) through the report's reader."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from process_groups import run_group

from stabmon.export.event_log import EventLog
from stabmon.report.events import read_run
from stabmon.report.incidents import (
    first_nonfinite_rank,
    incidents_section,
    replica_mismatches,
)
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter


def _log(run: Path, rank: int, records: list[tuple[str, dict[str, Any]]]) -> None:
    log = EventLog(run / f"rank-{rank}.events.jsonl", common={"run": "job", "rank": rank},
                   guard=Guard(LogLimiter()))  # fmt: skip
    log.write("attach", environment={}, config={}, pid=1)
    for event, fields in records:
        log.write(event, **fields)
    log.close()


def test_the_rank_whose_own_loss_went_non_finite_is_first_though_all_reduce_spread_it(
    tmp_path: Path,
) -> None:
    run = tmp_path / "job"
    # Rank 1's batch held a NaN at step 10; the all-reduce made rank 0's gradients NaN too.
    _log(run, 0, [
        ("anomaly", {"kind": "nonfinite_grad", "step": 10, "detail": "grads"}),
        ("batch_identities", {"step": 10, "kind": "nonfinite_grad",  # a get_batch() loop's
                              "batches": [{"step": 9, "rank": 0, "hashes": [-7, 12]}]}),
    ])  # fmt: skip
    _log(run, 1, [
        ("anomaly", {"kind": "nonfinite_loss", "step": 10, "detail": "loss"}),
        ("anomaly", {"kind": "nonfinite_grad", "step": 10, "detail": "grads"}),
        ("provenance", {"step": 10, "producer": None, "direction": None, "propagators": []}),
        ("batch_identities", {"step": 10, "kind": "nonfinite_loss",
                              "batches": [{"step": 10, "rank": 1, "indices": [40, 41]}]}),
    ])  # fmt: skip
    report = read_run(run)
    assert first_nonfinite_rank(report) == (1, 10)
    page = incidents_section(report)
    assert "First non-finite: rank 1 at step 10 (of 2 rank(s))" in page
    assert "not reproduced: a transient" in page
    assert "10: [40, 41]" in page
    assert "9: [-7, 12]" in page  # sample hashes where no index is known


def test_a_forward_producer_breaks_a_tie_of_gradients_only(tmp_path: Path) -> None:
    run = tmp_path / "job"
    for rank in (0, 1, 2):
        records: list[tuple[str, dict[str, Any]]] = [
            ("anomaly", {"kind": "nonfinite_grad", "step": 7, "detail": "grads"})
        ]
        if rank == 2:
            verdict = {"step": 7, "producer": "layers.3", "direction": "forward",
                       "propagators": ["head"]}  # fmt: skip
            records.append(("provenance", verdict))
        _log(run, rank, records)
    report = read_run(run)
    assert first_nonfinite_rank(report) == (2, 7)
    assert "layers.3" in incidents_section(report)


def test_a_clean_run_has_no_incident_section(tmp_path: Path) -> None:
    run = tmp_path / "job"
    _log(run, 0, [("anomaly", {"kind": "grad_spike", "step": 3, "detail": "spike"})])
    report = read_run(run)
    assert first_nonfinite_rank(report) is None
    assert incidents_section(report) == ""


@pytest.mark.slow
def test_two_gloo_ranks_name_the_rank_whose_batch_held_the_nan(tmp_path: Path) -> None:
    trainee = Path(__file__).with_name("nan_rank_trainee.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_group(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(trainee), str(tmp_path)],
        env=env, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = read_run(tmp_path / "nan-job")
    assert [log.rank for log in report.ranks] == [0, 1]
    assert first_nonfinite_rank(report) == (1, 10)


def test_a_replica_mismatch_is_one_row_naming_the_outvoted_rank_its_gpu_and_group(
    tmp_path: Path,
) -> None:
    run = tmp_path / "job"
    mismatch = {
        "kind": "replica_mismatch", "step": 59, "detail": "replicas differ",
        "groups": ["blocks.1"], "culprit_ranks": [2],
        "culprits": [{"rank": 2, "group": "blocks.1", "where": "node-7 GPU-12ab"}],
    }  # fmt: skip
    for rank in range(3):  # every rank of the group records the same verdict
        _log(run, rank, [("anomaly", mismatch)])
    report = read_run(run)

    assert [record["step"] for record in replica_mismatches(report)] == [59]
    page = incidents_section(report)
    assert "rank 2 (node-7 GPU-12ab, blocks.1)" in page and "stabmonreplicamismatch" in page
