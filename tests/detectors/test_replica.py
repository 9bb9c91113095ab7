"""A replica mismatch's message says where (groups, ranks, hosts and GPUs) and what to do."""

from __future__ import annotations

from stabmon.detectors.replica import ReplicaVerdict, mismatch_message


def test_the_message_names_the_culprit_its_gpu_and_its_group_and_says_what_to_do() -> None:
    verdict = ReplicaVerdict(
        step=59, groups=["blocks.1"], majority=True, culprits={2: "blocks.1"},
        where={2: "node-7 GPU-1234"}, replicas=4, how="DDP",
    )  # fmt: skip
    message = mismatch_message(verdict, rank=0)
    assert "after step 59" in message and "blocks.1" in message
    assert "rank 2 (node-7 GPU-1234, first in blocks.1)" in message
    assert "before the next checkpoint save" in message and "drain that node" in message


def test_without_a_majority_the_message_says_no_culprit_can_be_named() -> None:
    verdict = ReplicaVerdict(step=9, groups=["head"], majority=False, replicas=2, how="DDP")
    message = mismatch_message(verdict, rank=1)
    assert "no majority" in message and "either one may be wrong" in message


def test_the_message_names_the_last_step_the_replicas_agreed_not_the_step_of_the_check() -> None:
    # Checked every 10 steps: the replicas parted somewhere in steps 50..59, so a checkpoint
    # of step 55 ("before step 59") may hold the corrupted replica; resume from 49 or older.
    verdict = ReplicaVerdict(step=59, groups=["head"], majority=False, replicas=2, how="DDP",
                             every=10)  # fmt: skip
    message = mismatch_message(verdict, rank=0)
    assert "saved at or before step 49" in message and "before step 59" not in message
