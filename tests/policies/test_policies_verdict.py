"""stabmon.policies.verdict: the file a launcher reads, written safely, and good checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stabmon.policies.verdict import Checkpoints, Verdict, checkpoint_size
from stabmon.shared.safefs import UnsafePathError


def _verdict(tmp_path: Path) -> Verdict:
    return Verdict(tmp_path / "runs" / "run" / "rank-3.verdict.json", rank=3)


def test_the_verdict_names_every_field_in_the_resiliency_vocabulary(tmp_path: Path) -> None:
    verdict = _verdict(tmp_path)
    verdict.decide("stop", failure_domain="workload", reason="grad_spike at step 300",
                   kind="grad_spike", step=300,
                   recommended_action="resume from step 200")  # fmt: skip
    verdict.checkpoint({"path": "/ckpt/200.pt", "step": 200, "size": 10, "completed": True,
                        "good": True})  # fmt: skip
    verdict.write()

    data = json.loads(verdict.path.read_text())
    assert {k: data[k] for k in ("decision", "failure_domain", "kind", "step", "rank")} == {
        "decision": "stop", "failure_domain": "workload", "kind": "grad_spike", "step": 300,
        "rank": 3,
    }  # fmt: skip
    assert data["last_good_checkpoint"]["step"] == 200
    assert data["recommended_action"] == "resume from step 200" and data["updated"]


def test_a_stop_is_never_turned_back_into_continue(tmp_path: Path) -> None:
    verdict = _verdict(tmp_path)
    verdict.decide("stop", failure_domain="workload", reason="r", kind="k", step=1,
                   recommended_action="a")  # fmt: skip

    taken = verdict.decide("continue", failure_domain="workload", reason="later", kind="k",
                           step=2, recommended_action="none")  # fmt: skip

    assert not taken and verdict.state["decision"] == "stop"


def test_a_symlink_planted_as_the_verdict_is_replaced_not_written_through(tmp_path: Path) -> None:
    verdict = _verdict(tmp_path)
    verdict.path.parent.mkdir(parents=True)
    target = tmp_path / "victim.txt"
    target.write_text("keep")
    os.symlink(target, verdict.path)

    verdict.write()

    assert target.read_text() == "keep"
    assert not verdict.path.is_symlink() and json.loads(verdict.path.read_text())["rank"] == 3


def test_a_run_directory_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    verdict = _verdict(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    verdict.path.parent.parent.mkdir()
    os.symlink(elsewhere, verdict.path.parent)

    with pytest.raises(UnsafePathError):
        verdict.write()
    assert list(elsewhere.iterdir()) == []


def test_saves_are_good_until_the_parameters_are_damaged(tmp_path: Path) -> None:
    (tmp_path / "a.pt").write_bytes(b"x" * 5)
    checkpoints = Checkpoints()

    first = checkpoints.saved(10, str(tmp_path / "a.pt"), completed=True)
    failed = checkpoints.saved(15, str(tmp_path / "b.pt"), completed=False)
    checkpoints.damaged("replica_mismatch at step 20 reached the parameters before this save")
    later = checkpoints.saved(30, str(tmp_path / "a.pt"), completed=True)

    assert (first["good"], first["size"]) == (True, 5)
    assert failed["good"] is False and "raised" in failed["why_not_good"]
    assert later["good"] is False and "replica_mismatch" in later["why_not_good"]
    assert checkpoints.last_good == first and checkpoints.last == later


def test_a_directory_checkpoint_sums_its_files_and_a_missing_one_has_no_size(
    tmp_path: Path,
) -> None:
    (tmp_path / "ckpt" / "shards").mkdir(parents=True)
    (tmp_path / "ckpt" / "meta.json").write_bytes(b"12")
    (tmp_path / "ckpt" / "shards" / "0.distcp").write_bytes(b"123")

    assert checkpoint_size(str(tmp_path / "ckpt")) == 5
    assert checkpoint_size(str(tmp_path / "nothing")) is None


def test_a_save_without_a_path_never_hides_one_whose_path_is_known(tmp_path: Path) -> None:
    checkpoints = Checkpoints()

    unnamed = checkpoints.saved(5, None, completed=True)
    named = checkpoints.saved(10, str(tmp_path / "a.pt"), completed=True)
    checkpoints.saved(12, None, completed=True)

    assert checkpoints.last_good == named and unnamed["good"] is True
